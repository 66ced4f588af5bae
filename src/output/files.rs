//! How spool makes files and folders on a machine it shares with other users.
//!
//! Invariants:
//! - Modes are explicit: shards, exports and their folders are made [`FILE_MODE`] (0640)
//!   and [`DIR_MODE`] (0750), scratch [`PRIVATE_FILE_MODE`] and [`PRIVATE_DIR_MODE`]
//!   (0600, 0700); the umask can only take more away. The binary also adds [`UMASK`] to
//!   its umask at start ([`restrict_umask`]), so files its crates make (the queue's) are
//!   no more open than these.
//! - A file is never written through a name someone else planted: new files are created
//!   exclusively without following a symlink (`O_CREAT|O_EXCL|O_NOFOLLOW`), and a file
//!   replaced is first unlinked (which removes a symlink, never what it points to).
//! - Scratch is a fresh folder of random name made exclusively, 0700 ([`Scratch`]), under
//!   the output's own folder or `$TMPDIR`, and removed when its owner drops it.

use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Files spool writes for others to read (shards, exports): owner and group read.
pub const FILE_MODE: u32 = 0o640;
/// Folders of those files (made by the store's durable folder layer, whose mode it is).
pub use crate::store::blocks::DIR_MODE;
/// Scratch files: the owner's alone.
pub const PRIVATE_FILE_MODE: u32 = 0o600;
/// Scratch folders.
pub const PRIVATE_DIR_MODE: u32 = 0o700;
/// Bits the binary always adds to its umask: nothing for others, no writing for the group.
pub const UMASK: u32 = 0o027;

/// Adds [`UMASK`] to the process's umask (the user's stricter bits stay). Called once by
/// the binary before it starts any thread.
pub fn restrict_umask() {
    // SAFETY: umask has no memory effects; it is called before any other thread exists.
    unsafe {
        let old = libc::umask(0o077);
        libc::umask(old | UMASK as libc::mode_t);
    }
}

/// Creates `path` for writing with `mode`, failing if any name is there (a symlink
/// included).
pub fn create_new(path: &Path, mode: u32) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// Creates `path` for writing with `mode`, first removing whatever name was there (a
/// leftover of an earlier try, or a symlink someone planted: the link goes, not what it
/// points to).
pub fn replace(path: &Path, mode: u32) -> io::Result<File> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    create_new(path, mode)
}

/// Creates `dir` and its missing parents with `mode` (existing folders are left as they
/// are).
pub fn create_dir_all(dir: &Path, mode: u32) -> io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(dir)
}

/// Writes `bytes` to `path` whole or not at all: a hidden temporary file beside it
/// ([`FILE_MODE`], made exclusively), synced, renamed over `path`, the folder synced.
pub fn write_durably(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    let res = (|| {
        let mut f = replace(&tmp, FILE_MODE)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        crate::store::blocks::sync_parent(path)
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// A private scratch folder, removed (with all it holds) when dropped.
#[derive(Debug)]
pub struct Scratch {
    dir: tempfile::TempDir,
}

impl Scratch {
    /// A fresh folder `.spool-<what>-<random>` in `parent` (on the output's file system),
    /// made exclusively, 0700.
    pub fn new_in(parent: &Path, what: &str) -> io::Result<Scratch> {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::Builder::new()
            .prefix(&format!(".spool-{what}-"))
            .permissions(std::fs::Permissions::from_mode(PRIVATE_DIR_MODE))
            .tempdir_in(parent)?;
        Ok(Scratch { dir })
    }

    /// As [`Scratch::new_in`], in `$TMPDIR` (else `/tmp`).
    pub fn new(what: &str) -> io::Result<Scratch> {
        Self::new_in(&std::env::temp_dir(), what)
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The folder's path, for a handler that must remove it when the process is stopped
    /// before the drop.
    pub fn to_path_buf(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    /// A scratch folder is 0700 with a fresh name each time, its files 0600, and it is
    /// gone when dropped.
    #[test]
    fn scratch_is_private_fresh_and_removed() {
        let parent = tempfile::tempdir().unwrap();
        let a = Scratch::new_in(parent.path(), "verify").unwrap();
        let b = Scratch::new_in(parent.path(), "verify").unwrap();
        assert_ne!(a.path(), b.path());
        assert_eq!(mode(a.path()), 0o700);
        let f = a.path().join("shard.parquet");
        create_new(&f, PRIVATE_FILE_MODE).unwrap();
        assert_eq!(mode(&f) & !0o600, 0);
        let gone = a.to_path_buf();
        drop(a);
        assert!(!gone.exists());
    }

    /// A planted symlink is never written through: `create_new` refuses the name,
    /// `replace` removes the link and writes a file of its own; the victim keeps its bytes.
    #[test]
    fn planted_symlinks_are_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let planted = dir.path().join("planted");
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        assert!(create_new(&planted, FILE_MODE).is_err());
        replace(&planted, FILE_MODE)
            .unwrap()
            .write_all(b"mine")
            .unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert_eq!(std::fs::read(&planted).unwrap(), b"mine");
        assert!(!std::fs::symlink_metadata(&planted).unwrap().is_symlink());
        write_durably(&planted, b"whole").unwrap();
        assert_eq!(std::fs::read(&planted).unwrap(), b"whole");
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    }
}
