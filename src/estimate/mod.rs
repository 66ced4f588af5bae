//! Estimates: the completion-length model learnt from finished requests, and the
//! simulation of the run's tail that the ETA comes from.

pub mod lengths;
pub mod tail;
