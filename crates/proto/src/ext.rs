//! mbal's extension replies (docs/protocol.md, "mbal extensions"), written
//! here by the server and parsed by [`crate::client`], so the wire format
//! of each lives in one crate.

/// `MBAL <server> <worker> <epoch> [<threads>]`: the answer to `mbal hello`; `threads` to a
/// client that routes by thread (`mbal hello <epoch> <worker> threads`): worker `w` serves
/// such a client's requests for the keys of every worker `v` with `v % threads == w % threads`
/// (they share a thread; docs/protocol.md).
pub fn write_hello(out: &mut Vec<u8>, server: u16, worker: u16, epoch: u64, threads: Option<u16>) {
    match threads {
        None => line(out, b"MBAL", &[server as u64, worker as u64, epoch]),
        Some(t) => line(out, b"MBAL", &[server as u64, worker as u64, epoch, t as u64]),
    }
}

/// `RD <epoch> <server> <worker>`: a routed request's cachelet is served
/// by (server, worker).
pub fn write_redirect(out: &mut Vec<u8>, epoch: u64, server: u16, worker: u16) {
    line(out, b"RD", &[epoch, server as u64, worker as u64]);
}

/// `RD <epoch> <server> <worker> [<key>]`: with the key when it stands for
/// one key of a long get line (docs/protocol.md).
pub fn write_redirect_key(out: &mut Vec<u8>, epoch: u64, server: u16, worker: u16, key: Option<&[u8]>) {
    match key {
        None => write_redirect(out, epoch, server, worker),
        Some(key) => {
            out.extend_from_slice(b"RD ");
            let mut b = itoa::Buffer::new();
            for n in [epoch, server as u64, worker as u64] {
                out.extend_from_slice(b.format(n).as_bytes());
                out.push(b' ');
            }
            out.extend_from_slice(key);
            out.extend_from_slice(b"\r\n");
        }
    }
}

/// `RH hot <key> <replicas> <lease-ms>`: a hot key's hint, before the reply
/// to a read of it on a routed connection (docs/protocol.md).
pub fn write_hot_hint(out: &mut Vec<u8>, key: &[u8], replicas: u32, lease_ms: u64) {
    out.extend_from_slice(b"RH hot ");
    out.extend_from_slice(key);
    let mut b = itoa::Buffer::new();
    out.push(b' ');
    out.extend_from_slice(b.format(replicas).as_bytes());
    out.push(b' ');
    out.extend_from_slice(b.format(lease_ms).as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// `MOVED <epoch>`: the answer to `mbal move`.
pub fn write_moved(out: &mut Vec<u8>, epoch: u64) {
    line(out, b"MOVED", &[epoch]);
}

/// `OK <n>`: the answer to `mbal rttl` (the reads the renewed copy served
/// since it was made or last renewed).
pub fn write_ok_count(out: &mut Vec<u8>, n: u64) {
    line(out, b"OK", &[n]);
}

/// `SLOTS <granted> <lease ms>`: the answer to `mbal slots <borrower> ...`.
pub fn write_slots(out: &mut Vec<u8>, granted: u64, lease_ms: u64) {
    line(out, b"SLOTS", &[granted, lease_ms]);
}

/// `HELD <n>`: the answer to `mbal slots held <lender>`.
pub fn write_held(out: &mut Vec<u8>, n: u64) {
    line(out, b"HELD", &[n]);
}

/// `MAP <epoch> <bytes>` and the map's JSON: the answer to `mbal map`.
pub fn write_map(out: &mut Vec<u8>, epoch: u64, json: &[u8]) {
    blob(out, b"MAP", epoch, json);
}

/// The answer to `mbal map <have>`: the map if its epoch is above `have`, else
/// `MAP <epoch> 0` with no JSON (the asker's map is as new: nothing to send or parse).
pub fn write_map_since(out: &mut Vec<u8>, epoch: u64, have: Option<u64>, json: impl FnOnce() -> Vec<u8>) {
    if have.is_some_and(|h| h >= epoch) {
        write_map(out, epoch, b"");
    } else {
        write_map(out, epoch, &json());
    }
}

/// `mbal map [<have>]`: with the epoch of the map the asker has, the map comes only if newer
/// (a refresh while a server is down asks every 200 ms; docs/protocol.md).
pub fn map_request(have: Option<u64>) -> Vec<u8> {
    match have {
        Some(e) => format!("mbal map {e}\r\n").into_bytes(),
        None => b"mbal map\r\n".to_vec(),
    }
}

/// `LOAD <seq> <bytes>` and an epoch snapshot's JSON: the answer to
/// `mbal load`.
pub fn write_load(out: &mut Vec<u8>, seq: u64, json: &[u8]) {
    blob(out, b"LOAD", seq, json);
}

fn line(out: &mut Vec<u8>, word: &[u8], nums: &[u64]) {
    let mut b = itoa::Buffer::new();
    out.extend_from_slice(word);
    for &n in nums {
        out.push(b' ');
        out.extend_from_slice(b.format(n).as_bytes());
    }
    out.extend_from_slice(b"\r\n");
}

fn blob(out: &mut Vec<u8>, word: &[u8], n: u64, body: &[u8]) {
    line(out, word, &[n, body.len() as u64]);
    out.extend_from_slice(body);
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{Expect, Reply, ReplyReader};

    /// What the server writes, the client codec reads back.
    #[test]
    fn every_extension_reply_round_trips_through_the_client_codec() {
        let mut out = Vec::new();
        write_hello(&mut out, 3, 1, 42, Some(2));
        write_redirect(&mut out, 43, 2, 0);
        write_moved(&mut out, 44);
        write_map(&mut out, 45, b"{\"m\":1}");
        write_load(&mut out, 7, b"{\"seq\":7}");
        assert_eq!(&out[..16], b"MBAL 3 1 42 2\r\nR");
        let mut r = ReplyReader::new();
        r.feed(&out);
        assert_eq!(r.next(Expect::Line).unwrap(), Some(Reply::Hello { server: 3, worker: 1, epoch: 42, threads: 2 }));
        assert_eq!(r.next(Expect::Line).unwrap(), Some(Reply::Redirect { epoch: 43, server: 2, worker: 0 }));
        assert_eq!(r.next(Expect::Line).unwrap(), Some(Reply::Moved { epoch: 44 }));
        assert_eq!(r.next(Expect::Line).unwrap(), Some(Reply::Map { epoch: 45, json: b"{\"m\":1}".to_vec() }));
        assert_eq!(r.next(Expect::Line).unwrap(), Some(Reply::Load { seq: 7, json: b"{\"seq\":7}".to_vec() }));
        assert_eq!(r.next(Expect::Line).unwrap(), None);
        // A hello without the thread count (an older server): route per worker.
        r.feed(b"MBAL 3 1 42\r\nMBAL 3 1 42 x\r\n");
        assert_eq!(r.next(Expect::Line).unwrap(), Some(Reply::Hello { server: 3, worker: 1, epoch: 42, threads: 0 }));
        assert!(r.next(Expect::Line).is_err(), "a thread count that is not a number");
    }

    #[test]
    fn a_map_asked_since_an_epoch_comes_only_if_newer() {
        let json = || b"{\"m\":1}".to_vec();
        let mut out = Vec::new();
        write_map_since(&mut out, 5, Some(5), json);
        write_map_since(&mut out, 5, Some(9), json);
        write_map_since(&mut out, 5, Some(4), json);
        write_map_since(&mut out, 5, None, json);
        let mut r = ReplyReader::new();
        r.feed(&out);
        for want in [&b""[..], b"", b"{\"m\":1}", b"{\"m\":1}"] {
            assert_eq!(r.next(Expect::Line).unwrap(), Some(Reply::Map { epoch: 5, json: want.to_vec() }));
        }
        assert_eq!(map_request(Some(7)), b"mbal map 7\r\n");
        assert_eq!(map_request(None), b"mbal map\r\n");
    }
}
