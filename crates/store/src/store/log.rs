//! memcached's `watch` log streaming, the store's part: while a watcher wants them, the
//! store writes one line per event it sees (a lookup, a store, an eviction) in memcached
//! 1.6's format, from `type=` on; the server prefixes each with `ts=` and `gid=` and sends
//! it to the watchers (docs/protocol.md "watch"). Off (no category wanted), each access
//! costs one branch.

use std::io::Write;

/// The categories of `watch fetchers mutations evictions`.
pub const FETCHERS: u8 = 1;
pub const MUTATIONS: u8 = 2;
pub const EVICTIONS: u8 = 4;

/// The most bytes of lines kept between two takes; past it lines are dropped (counted).
const MAX_BYTES: usize = 1 << 20;

/// One worker's event lines since the server last took them.
#[derive(Debug, Default)]
pub struct EventLog {
    /// The categories some watcher wants (0: logging off).
    mask: u8,
    /// The client connection whose request runs (memcached's `cfd`).
    pub cfd: u64,
    buf: Vec<u8>,
    /// Each line's category and end in `buf`.
    lines: Vec<(u8, u32)>,
    /// Lines dropped for want of room.
    pub dropped: u64,
}

impl EventLog {
    pub fn set_mask(&mut self, mask: u8) {
        self.mask = mask;
    }

    #[inline]
    pub fn wants(&self, cat: u8) -> bool {
        self.mask & cat != 0
    }

    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    /// The lines kept, each with its category, in order; then forget them.
    pub fn take(&mut self, mut f: impl FnMut(u8, &[u8])) {
        let mut at = 0;
        for &(cat, end) in &self.lines {
            f(cat, &self.buf[at..end as usize]);
            at = end as usize;
        }
        self.lines.clear();
        self.buf.clear();
    }

    /// Write one line of `cat` (without its newline) with `w`, unless it is not wanted or
    /// there is no room.
    fn line(&mut self, cat: u8, w: impl FnOnce(&mut Vec<u8>)) {
        if !self.wants(cat) {
            return;
        }
        if self.buf.len() >= MAX_BYTES {
            self.dropped += 1;
            return;
        }
        w(&mut self.buf);
        self.buf.push(b'\n');
        self.lines.push((cat, self.buf.len() as u32));
    }

    /// A lookup: `type=item_get key=<k> status=found|not_found clsid=<c> cfd=<c> size=<n>`.
    pub fn fetch(&mut self, key: &[u8], found: Option<(u32, usize)>) {
        let cfd = self.cfd;
        self.line(FETCHERS, |b| {
            b.extend_from_slice(b"type=item_get key=");
            b.extend_from_slice(key);
            let (status, cls, size) = match found {
                Some((cls, size)) => ("found", cls, size),
                None => ("not_found", 0, 0),
            };
            let _ = write!(b, " status={status} clsid={cls} cfd={cfd} size={size}");
        });
    }

    /// A store: `type=item_store key=<k> status=<s> cmd=<c> ttl=<t> clsid=<c> cfd=<c> size=<n>`.
    pub fn store(&mut self, key: &[u8], status: &str, cmd: &str, ttl: i64, cls: u32, size: usize) {
        let cfd = self.cfd;
        self.line(MUTATIONS, |b| {
            b.extend_from_slice(b"type=item_store key=");
            b.extend_from_slice(key);
            let _ = write!(b, " status={status} cmd={cmd} ttl={ttl} clsid={cls} cfd={cfd} size={size}");
        });
    }

    /// An eviction: `type=eviction key=<k> fetch=yes|no ttl=<t, -1: never> la=<seconds
    /// since last access> clsid=<c> size=<value bytes>`.
    pub fn evict(&mut self, key: &[u8], fetched: bool, ttl: i64, la: u32, cls: u32, size: usize) {
        self.line(EVICTIONS, |b| {
            b.extend_from_slice(b"type=eviction key=");
            b.extend_from_slice(key);
            let fetch = if fetched { "yes" } else { "no" };
            let _ = write!(b, " fetch={fetch} ttl={ttl} la={la} clsid={cls} size={size}");
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_kept_only_when_wanted_and_bounded() {
        let mut l = EventLog::default();
        l.fetch(b"k", None);
        assert!(l.is_empty(), "off");
        l.set_mask(FETCHERS | EVICTIONS);
        l.cfd = 9;
        l.fetch(b"k", None);
        l.fetch(b"k", Some((2, 5)));
        l.store(b"k", "stored", "set", 0, 1, 2);
        l.evict(b"e", false, -1, 3, 1, 7);
        let mut got = Vec::new();
        l.take(|cat, line| got.push((cat, String::from_utf8_lossy(line).into_owned())));
        assert_eq!(
            got,
            [
                (FETCHERS, "type=item_get key=k status=not_found clsid=0 cfd=9 size=0\n".to_string()),
                (FETCHERS, "type=item_get key=k status=found clsid=2 cfd=9 size=5\n".to_string()),
                (EVICTIONS, "type=eviction key=e fetch=no ttl=-1 la=3 clsid=1 size=7\n".to_string()),
            ]
        );
        assert!(l.is_empty());
        for _ in 0..100_000 {
            l.fetch(&[b'k'; 200], None);
        }
        assert!(l.dropped > 0 && l.buf.len() < MAX_BYTES + 400);
    }
}
