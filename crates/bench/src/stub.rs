//! A tiny memcached text-protocol server (get/gets, set/add/replace, delete, version), one
//! thread per connection, one shared map. It is the `--null-server` target (to measure the
//! generator's own ceiling) and the peer of the end-to-end tests. Not a cache: no limits,
//! no eviction; bind it to 127.0.0.1 only.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use memchr::memchr;

#[derive(Default)]
pub struct StubStats {
    /// Requests (commands) served.
    pub requests: AtomicU64,
    pub gets: AtomicU64,
    pub sets: AtomicU64,
}

/// Handle of a running stub server. The listener thread stops when this is dropped (it is
/// woken by a connection to itself); connection threads end when their client disconnects.
pub struct StubServer {
    pub addr: SocketAddr,
    pub stats: Arc<StubStats>,
    stop: Arc<AtomicBool>,
}

type Store = Arc<Mutex<HashMap<Vec<u8>, Vec<u8>>>>;

impl StubServer {
    /// Start on 127.0.0.1 with an ephemeral port.
    pub fn start() -> std::io::Result<StubServer> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let stats = Arc::new(StubStats::default());
        let stop = Arc::new(AtomicBool::new(false));
        let store: Store = Arc::default();
        let (st, sp) = (stats.clone(), stop.clone());
        std::thread::Builder::new().name("stub-accept".into()).spawn(move || {
            for conn in listener.incoming() {
                if sp.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let (st, store) = (st.clone(), store.clone());
                let _ = std::thread::Builder::new().name("stub-conn".into()).spawn(move || serve(conn, &store, &st));
            }
        })?;
        Ok(StubServer { addr, stats, stop })
    }
}

impl Drop for StubServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(self.addr);
    }
}

fn serve(mut conn: TcpStream, store: &Store, stats: &StubStats) {
    let _ = conn.set_nodelay(true);
    let mut buf = vec![0u8; 64 * 1024];
    let (mut start, mut end) = (0usize, 0usize);
    let mut out = Vec::with_capacity(64 * 1024);
    loop {
        if end == buf.len() {
            if start > 0 {
                buf.copy_within(start..end, 0);
                end -= start;
                start = 0;
            } else {
                let n = buf.len() * 2;
                buf.resize(n, 0);
            }
        }
        let n = match conn.read(&mut buf[end..]) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        end += n;
        // handle every complete command
        loop {
            let data = &buf[start..end];
            let Some(nl) = memchr(b'\n', data) else { break };
            let line = data[..nl].strip_suffix(b"\r").unwrap_or(&data[..nl]);
            let mut toks = line.split(|&b| b == b' ').filter(|t| !t.is_empty());
            let cmd = toks.next().unwrap_or(b"");
            let mut used = nl + 1;
            match cmd {
                b"get" | b"gets" => {
                    stats.gets.fetch_add(1, Ordering::Relaxed);
                    let map = store.lock().unwrap();
                    for k in toks {
                        if let Some(v) = map.get(k) {
                            out.extend_from_slice(b"VALUE ");
                            out.extend_from_slice(k);
                            out.extend_from_slice(format!(" 0 {}", v.len()).as_bytes());
                            if cmd == b"gets" {
                                out.extend_from_slice(b" 1");
                            }
                            out.extend_from_slice(b"\r\n");
                            out.extend_from_slice(v);
                            out.extend_from_slice(b"\r\n");
                        }
                    }
                    out.extend_from_slice(b"END\r\n");
                }
                b"set" | b"add" | b"replace" => {
                    let t: Vec<&[u8]> = toks.collect();
                    let bytes = t.get(3).and_then(|b| std::str::from_utf8(b).ok()?.parse::<usize>().ok());
                    let (Some(key), Some(bytes)) = (t.first(), bytes) else {
                        out.extend_from_slice(b"CLIENT_ERROR bad command line format\r\n");
                        start += used;
                        continue;
                    };
                    if data.len() < used + bytes + 2 {
                        break; // wait for the body
                    }
                    let noreply = t.get(4) == Some(&&b"noreply"[..]);
                    let value = data[used..used + bytes].to_vec();
                    used += bytes + 2;
                    stats.sets.fetch_add(1, Ordering::Relaxed);
                    let mut map = store.lock().unwrap();
                    let exists = map.contains_key(*key);
                    let ok = match cmd {
                        b"add" => !exists,
                        b"replace" => exists,
                        _ => true,
                    };
                    if ok {
                        map.insert(key.to_vec(), value);
                    }
                    if !noreply {
                        out.extend_from_slice(if ok { b"STORED\r\n" } else { b"NOT_STORED\r\n" });
                    }
                }
                b"delete" => {
                    let found = toks.next().map(|k| store.lock().unwrap().remove(k).is_some());
                    out.extend_from_slice(if found == Some(true) { b"DELETED\r\n" } else { b"NOT_FOUND\r\n" });
                }
                b"version" => out.extend_from_slice(b"VERSION stub\r\n"),
                b"quit" => return,
                _ => out.extend_from_slice(b"ERROR\r\n"),
            }
            stats.requests.fetch_add(1, Ordering::Relaxed);
            start += used;
        }
        if start == end {
            start = 0;
            end = 0;
        }
        if !out.is_empty() {
            if conn.write_all(&out).is_err() {
                return;
            }
            out.clear();
        }
    }
}
