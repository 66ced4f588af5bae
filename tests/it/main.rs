//! The one integration-test binary: every test runs the real library or the real `spool`
//! binary against the bundled mock server on loopback.

mod support;

mod crash;
mod demo;
mod e2e;
mod mock_server;
mod shard_read;
mod template_golden;
mod verify;
