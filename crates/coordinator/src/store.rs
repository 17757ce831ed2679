//! The embedded file store: `DIR/state.json` holds the map and the members'
//! states ([`Stored`]). A write is crash-safe: the new state goes to a temp
//! file in DIR, which is fsynced and renamed over `state.json`, and DIR is
//! fsynced; a crash leaves either the old file or the new one, never a
//! torn one. A temp file left by a crash is ignored (and removed) at start.

use crate::state::Stored;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// The state file's name in the data directory.
pub const STATE_FILE: &str = "state.json";
/// The temp file a write goes through.
pub const TEMP_FILE: &str = "state.json.tmp";
/// The file a running coordinator holds locked.
pub const LOCK_FILE: &str = "lock";

/// A data directory.
#[derive(Clone, Debug)]
pub struct FileStore {
    dir: PathBuf,
}

impl FileStore {
    /// Open (creating it if needed) a data directory; a leftover temp file
    /// is removed.
    pub fn open(dir: &Path) -> io::Result<FileStore> {
        fs::create_dir_all(dir)?;
        match fs::remove_file(dir.join(TEMP_FILE)) {
            Ok(()) => tracing::warn!("{}: removed a temp file left by an interrupted write", dir.display()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        Ok(FileStore { dir: dir.to_path_buf() })
    }

    /// Take the directory for this process: an exclusive `flock` on
    /// `DIR/lock`, held until the returned file is dropped. A second
    /// coordinator on the same directory is refused.
    pub fn lock(&self) -> io::Result<File> {
        use std::os::fd::AsRawFd;
        let f = fs::OpenOptions::new().create(true).truncate(false).write(true).open(self.dir.join(LOCK_FILE))?;
        // SAFETY: flock on a descriptor we own; no memory is passed.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(
                e.kind(),
                format!("{}: in use by another coordinator ({e})", self.dir.display()),
            ));
        }
        Ok(f)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The stored state, None if there is none yet.
    pub fn load(&self) -> Result<Option<Stored>, String> {
        let path = self.dir.join(STATE_FILE);
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        let s: Stored = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        s.check().map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Some(s))
    }

    /// Write the state crash-safely (see the module docs).
    pub fn save(&self, s: &Stored) -> io::Result<()> {
        let json = serde_json::to_vec(s).map_err(io::Error::other)?;
        let tmp = self.dir.join(TEMP_FILE);
        let mut f = File::create(&tmp)?;
        f.write_all(&json)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, self.dir.join(STATE_FILE))?;
        File::open(&self.dir)?.sync_all()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Member, MemberState};
    use mbal_cluster::{ClusterMap, ServerInfo};

    fn stored() -> Stored {
        let servers = (0..3u16)
            .map(|i| ServerInfo {
                main: format!("127.0.0.1:{}", 30000 + i).parse().unwrap(),
                workers: vec![format!("127.0.0.1:{}", 31000 + i).parse().unwrap(); 2],
            })
            .collect();
        let mut map = ClusterMap::even(servers, 4, 1024);
        map.reassign(&[(0, (2, 1)), (5, (1, 0))]).unwrap();
        let mut s = Stored::initial(map);
        s.members[1] = Member { state: MemberState::Down, memory_bytes: 64 << 20 };
        s.members[2].state = MemberState::Left;
        s
    }

    #[test]
    fn a_written_state_reads_back_equal() {
        let dir = tempfile::tempdir().unwrap();
        let st = FileStore::open(dir.path()).unwrap();
        assert_eq!(st.load().unwrap(), None);
        let s = stored();
        st.save(&s).unwrap();
        assert_eq!(st.load().unwrap(), Some(s.clone()));
        assert_eq!(FileStore::open(dir.path()).unwrap().load().unwrap().unwrap().map.epoch(), 2);
        assert!(!dir.path().join(TEMP_FILE).exists());
        // The map inside is the map's own JSON (the `mbal map` wire format).
        let v: serde_json::Value = serde_json::from_slice(&fs::read(dir.path().join(STATE_FILE)).unwrap()).unwrap();
        assert_eq!(v["map"]["layout"]["cachelet_owner"][0], serde_json::json!([2, 1]));
        assert_eq!(v["members"][1]["state"], "down");
    }

    #[test]
    fn a_torn_temp_file_is_ignored_and_a_torn_state_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let s = stored();
        FileStore::open(dir.path()).unwrap().save(&s).unwrap();
        let json = serde_json::to_vec(&s).unwrap();
        fs::write(dir.path().join(TEMP_FILE), &json[..json.len() / 2]).unwrap();
        let st = FileStore::open(dir.path()).unwrap();
        assert_eq!(st.load().unwrap(), Some(s));
        assert!(!dir.path().join(TEMP_FILE).exists(), "removed at start");
        // A state file that is not whole (never written by save) is refused, not guessed at.
        fs::write(dir.path().join(STATE_FILE), &json[..json.len() / 2]).unwrap();
        assert!(st.load().unwrap_err().contains(STATE_FILE));
    }

    #[test]
    fn one_coordinator_per_directory() {
        let dir = tempfile::tempdir().unwrap();
        let st = FileStore::open(dir.path()).unwrap();
        let held = st.lock().unwrap();
        assert!(st.lock().unwrap_err().to_string().contains("another coordinator"));
        drop(held);
        st.lock().unwrap();
    }
}
