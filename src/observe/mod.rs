//! Observation: metrics, the HTTP endpoint, `spool status`, progress lines and bars. Reads
//! the run's state, never changes it; text from outside goes through `printable` before it
//! is shown.

pub mod bars;
pub mod figures;
pub mod http;
pub mod metrics;
pub mod monitor;
pub mod printable;
pub mod progress;
pub mod status;
