//! The binary's commands: a function per command, each taking what its flags say and
//! returning its exit code; and the signal handling they share. Only this folder and
//! `main.rs` print to stdout.

pub(crate) mod commands;
pub(crate) mod signals;
