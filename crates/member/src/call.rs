//! Blocking calls from one member to another (replication, slot lending, peer load, the
//! coordinators' map): a request written whole, its reply read with the one reply codec
//! (`mbal_proto::client::ReplyReader`), one at a time or a batch of requests and then their
//! replies in order.

use crate::dial::{Dialer, Proto};
use mbal_proto::client::{Expect, Reply, ReplyReader};
use mbal_tls::BlockingStream;
use std::io::{self, Write};
use std::net::SocketAddr;

/// One blocking connection to a member's text port, with its reply reader.
pub struct MemberConn {
    s: BlockingStream,
    rr: ReplyReader,
}

impl MemberConn {
    /// Dial a member's text port: TLS and the membership proof (`mbal peer`) as `dialer` has
    /// them, bounded by its timeout.
    pub fn dial(dialer: &Dialer, addr: SocketAddr) -> io::Result<MemberConn> {
        Ok(MemberConn::over(dialer.dial(addr, Proto::Text)?))
    }

    /// A connection already open (e.g. to a coordinator, which has no login).
    pub fn over(s: BlockingStream) -> MemberConn {
        MemberConn { s, rr: ReplyReader::new() }
    }

    /// Write requests (one, or a batch whose replies are read after).
    pub fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.s.write_all(bytes)?;
        self.s.flush()
    }

    /// The next reply: a line, or the block a line announces (`MAP`, `LOAD`).
    pub fn reply(&mut self) -> io::Result<Reply> {
        self.rr.read_reply(&mut self.s, Expect::Line)
    }

    /// One request, one reply.
    pub fn call(&mut self, req: &[u8]) -> io::Result<Reply> {
        self.send(req)?;
        self.reply()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};
    use std::time::Duration;

    #[test]
    fn a_call_reads_its_reply_with_the_codec_and_a_batch_reads_them_in_order() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut w = s.try_clone().unwrap();
            let mut lines = BufReader::new(s).lines();
            assert_eq!(lines.next().unwrap().unwrap(), "mbal load 0");
            w.write_all(b"LOAD 3 2\r\n{}\r\n").unwrap();
            assert_eq!(lines.next().unwrap().unwrap(), "a");
            assert_eq!(lines.next().unwrap().unwrap(), "b");
            w.write_all(b"STORED\r\nDELETED\r\n").unwrap();
        });
        let mut c = MemberConn::dial(&Dialer::plain(Duration::from_secs(5)), addr).unwrap();
        match c.call(b"mbal load 0\r\n").unwrap() {
            Reply::Load { seq, json } => assert_eq!((seq, json), (3, b"{}".to_vec())),
            other => panic!("{other:?}"),
        }
        c.send(b"a\r\nb\r\n").unwrap();
        assert!(matches!(c.reply().unwrap(), Reply::Stored));
        assert!(matches!(c.reply().unwrap(), Reply::Deleted));
        server.join().unwrap();
    }
}
