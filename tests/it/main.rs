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
mod endpoint;
mod export;
mod export_batch;
mod export_gates;
mod export_readers;
mod export_report;
mod export_specforge;
mod export_speculators;
mod export_tools;
mod fast_bpe;
mod faults;
mod forged;
mod hostile;
mod input_bombs;
mod inputs;
mod kimi_tokenizer;
mod kimi_tools;
mod llama_server;
mod mock_server;
mod observability;
mod power;
mod private_files;
mod s3;
mod secrets;
mod security;
mod server_render;
mod shard_read;
mod signals;
mod syntax;
mod template_golden;
mod template_parity;
mod tls;
mod verify;
