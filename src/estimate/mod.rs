//! Estimates: the completion-length model learnt from finished requests, the server's speed
//! learnt from the monitor's samples, and the simulation of the run's tail that the ETA
//! comes from.

pub mod lengths;
pub mod speed;
pub mod tail;
