//! The one integration-test binary: every test runs the real library or the real `spool`
//! binary against the bundled mock server on loopback.

mod process;
mod support;

mod autoconc;
mod bad_input;
mod budget;
mod cluster;
mod crash;
mod demo;
mod deploy;
mod drafter;
mod e2e;
mod export;
mod export_batch;
mod export_gates;
mod export_readers;
mod export_specforge;
mod export_speculators;
mod fast_bpe;
mod faults;
mod hostile;
mod inputs;
mod kimi_tools;
mod mock_server;
mod observability;
mod power;
mod s3;
mod security;
mod shard_read;
mod signals;
mod template_golden;
mod template_parity;
mod tls;
mod verify;
