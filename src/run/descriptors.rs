//! File descriptors: at start a run raises its soft `RLIMIT_NOFILE` to the hard limit (as
//! Go and systemd services do), keeps a reserve for its own files and sockets, and gives
//! the metrics endpoint a small fixed share of the rest.
//!
//! Invariant: the endpoint never holds more than its share, so no number of clients can
//! take the descriptors the queue, the shards, the inputs and the servers' connections need.

/// Most sockets the endpoint holds at once, however high the limit: a scrape and a few
/// `spool status` calls need a handful.
pub const ENDPOINT_MAX: usize = 32;

/// Descriptors the run keeps for itself: the queue (sled's log and snapshots, the item
/// block files), stdio and the runtime; per dataset its input, open shard, rejected-rows
/// and results files; per request slot its connection and one being replaced.
pub fn reserve(concurrency: usize, datasets: usize) -> u64 {
    128 + 2 * concurrency as u64 + 8 * datasets as u64
}

/// The endpoint's share of `limit` descriptors after `reserve`: half of what is left, at
/// most [`ENDPOINT_MAX`], at least 1 (the endpoint then answers one client at a time).
pub fn endpoint_share(limit: u64, reserve: u64) -> usize {
    let spare = limit.saturating_sub(reserve) / 2;
    usize::try_from(spare)
        .unwrap_or(usize::MAX)
        .clamp(1, ENDPOINT_MAX)
}

/// Raises the soft limit on open files to the hard one; returns the soft limit in force
/// afterwards. A limit that cannot be read or raised is left as it is.
pub fn raise_soft_limit() -> u64 {
    // SAFETY: getrlimit/setrlimit only read and write the struct passed.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 1024;
        }
        // Linux refuses more than fs.nr_open (1 Mi by default), and an infinite hard
        // limit cannot be the soft one.
        let want = lim.rlim_max.min(1 << 20);
        if want > lim.rlim_cur {
            let raised = libc::rlimit {
                rlim_cur: want,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim.rlim_cur = want;
            }
        }
        lim.rlim_cur as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The endpoint gets half of what the reserve leaves, within 1..=ENDPOINT_MAX.
    #[test]
    fn the_endpoint_gets_a_bounded_share() {
        assert_eq!(endpoint_share(1 << 20, reserve(150, 4)), ENDPOINT_MAX);
        assert_eq!(endpoint_share(200, reserve(16, 1)), 16);
        assert_eq!(endpoint_share(100, reserve(16, 1)), 1);
    }
}
