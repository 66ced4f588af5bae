//! Signals as the commands meet them: `run` drains on the first SIGINT/SIGTERM and exits at
//! once on a second; the other commands remove their scratch and temporary outputs and
//! exit 130.

use spool::error::exit;
use std::path::PathBuf;

/// Resolves on the first SIGINT/SIGTERM; a second one exits at once (resume stays exact:
/// nothing is acknowledged that is not durable).
pub(crate) async fn first_signal() {
    wait_signal().await;
    tokio::spawn(async {
        wait_signal().await;
        eprintln!("spool: second signal: exiting now");
        std::process::exit(i32::from(exit::INTERRUPTED));
    });
}

/// What the signal handler of [`remove_on_signal`] removes.
pub(crate) static ON_SIGNAL: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Removes what [`ON_SIGNAL`] holds and exits 130 on the first SIGINT or SIGTERM: a command
/// holding scratch or a temporary output leaves nothing behind when stopped (a normal end
/// removes them itself). Returns once the handler is in place, so a path is added to
/// [`ON_SIGNAL`] before the path exists.
pub(crate) fn remove_on_signal() {
    let (ready, wait) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            let _ = ready.send(());
            return;
        };
        rt.block_on(async move {
            use tokio::signal::unix::{signal, SignalKind};
            let (Ok(mut int), Ok(mut term)) = (
                signal(SignalKind::interrupt()),
                signal(SignalKind::terminate()),
            ) else {
                let _ = ready.send(());
                return;
            };
            let _ = ready.send(());
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
            let paths = ON_SIGNAL.lock().map(|p| p.clone()).unwrap_or_default();
            for p in &paths {
                let _ = std::fs::remove_dir_all(p).or_else(|_| std::fs::remove_file(p));
            }
            eprintln!("spool: interrupted; its scratch and temporary files are removed");
            std::process::exit(i32::from(exit::INTERRUPTED));
        });
    });
    let _ = wait.recv();
}

/// Adds `path` to what a signal removes ([`remove_on_signal`]).
pub(crate) fn remove_on_signal_too(path: PathBuf) {
    if let Ok(mut p) = ON_SIGNAL.lock() {
        p.push(path);
    }
}

/// A scratch folder made by `make`, added to what a signal removes with no moment between
/// (the handler waits for the list while the folder is made).
pub(crate) fn scratch_removed_on_signal(
    make: impl FnOnce() -> std::io::Result<spool::output::files::Scratch>,
) -> std::io::Result<spool::output::files::Scratch> {
    let mut paths = ON_SIGNAL.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = make()?;
    paths.push(scratch.to_path_buf());
    Ok(scratch)
}

pub(crate) async fn wait_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut int), Ok(mut term)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            let _ = tokio::signal::ctrl_c().await;
            return;
        };
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
