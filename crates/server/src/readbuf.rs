//! A connection's input buffer that is not zeroed again before every read.
//!
//! Reading into a `Vec<u8>` needs its bytes initialised; growing it with
//! `resize(len + chunk, 0)` before each `read` writes `chunk` zeroes every
//! time, although the bytes past `len` were initialised by an earlier read
//! or fill and only truncated away. With small pipelined requests that is a
//! 16 KiB memset per read system call, more than the requests it carries.
//! `ReadBuf` remembers how far its allocation has been initialised and
//! zeroes only what never was (std's `BorrowedBuf` does the same inside
//! `read_to_end`).

use std::io::{self, Read};

#[derive(Default)]
pub(crate) struct ReadBuf {
    buf: Vec<u8>,
    /// Bytes `[0, init)` of the allocation at address `at` have been
    /// written (and never de-initialised: truncating a `Vec<u8>` leaves its
    /// bytes as they are). A different address means a new allocation,
    /// initialised up to `len` only.
    init: usize,
    at: usize,
}

impl ReadBuf {
    pub fn from_vec(buf: Vec<u8>) -> ReadBuf {
        let (init, at) = (buf.len(), buf.as_ptr() as usize);
        ReadBuf { buf, init, at }
    }

    /// Read once from `r` into up to `chunk` bytes past the end; returns
    /// what `read` returned. The buffer keeps the bytes read, nothing more.
    pub fn read_from(&mut self, r: &mut impl Read, chunk: usize) -> io::Result<usize> {
        let len = self.buf.len();
        self.buf.reserve(chunk);
        if self.buf.as_ptr() as usize != self.at {
            self.at = self.buf.as_ptr() as usize;
            self.init = len;
        }
        self.init = self.init.clamp(len, self.buf.capacity());
        let want = len + chunk;
        if self.init < want {
            let spare = self.buf.spare_capacity_mut();
            for b in &mut spare[self.init - len..chunk] {
                b.write(0);
            }
            self.init = want;
        }
        // SAFETY: `want <= capacity` (reserved above) and every byte of
        // `[len, want)` is initialised: `[len, init)` by an earlier read or
        // fill into this same allocation (checked by its address), the rest
        // zeroed just now.
        unsafe { self.buf.set_len(want) };
        let got = r.read(&mut self.buf[len..]);
        let n = *got.as_ref().unwrap_or(&0);
        self.buf.truncate(len + n);
        got
    }
}

impl std::ops::Deref for ReadBuf {
    type Target = Vec<u8>;
    fn deref(&self) -> &Vec<u8> {
        &self.buf
    }
}

/// The only ways the buffer changes besides reading: each keeps `init`
/// true of the allocation (no `DerefMut`: a `Vec` replaced through it could
/// land at the freed one's address with its bytes uninitialised).
impl ReadBuf {
    /// Drop the first `n` bytes (consumed input). The bytes move down; the
    /// allocation and what it has initialised stay.
    pub fn consume(&mut self, n: usize) {
        self.buf.drain(..n.min(self.buf.len()));
    }

    /// Give back memory beyond `min` (in place or not, `init` follows).
    pub fn shrink_to(&mut self, min: usize) {
        self.buf.shrink_to(min);
        if self.buf.as_ptr() as usize != self.at {
            self.at = self.buf.as_ptr() as usize;
            self.init = self.buf.len();
        }
        self.init = self.init.min(self.buf.capacity());
    }

    /// Take the bytes from `at` on (this buffer keeps its allocation).
    pub fn split_off(&mut self, at: usize) -> Vec<u8> {
        self.buf.split_off(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_append_and_survive_drain_shrink_and_moves() {
        let mut b = ReadBuf::default();
        let mut src: &[u8] = b"hello world";
        assert_eq!(b.read_from(&mut src, 5).unwrap(), 5);
        assert_eq!(&b[..], b"hello");
        assert_eq!(b.read_from(&mut src, 64).unwrap(), 6);
        assert_eq!(&b[..], b"hello world");
        b.consume(6);
        assert_eq!(&b[..], b"world");
        let mut more: &[u8] = b"!!";
        b.read_from(&mut more, 1 << 16).unwrap(); // reallocates
        assert_eq!(&b[..], b"world!!");
        b.shrink_to(8);
        let mut more: &[u8] = b"?";
        b.read_from(&mut more, 16).unwrap();
        assert_eq!(&b[..], b"world!!?");
        let mut eof: &[u8] = b"";
        assert_eq!(b.read_from(&mut eof, 16).unwrap(), 0);
        assert_eq!(&b[..], b"world!!?");
        let tail = b.split_off(5);
        assert_eq!(tail, b"!!?");
        let mut b = ReadBuf::from_vec(tail);
        let mut x: &[u8] = b"x";
        b.read_from(&mut x, 4).unwrap();
        assert_eq!(&b[..], b"!!?x");
    }

    #[test]
    fn an_error_keeps_what_was_there() {
        struct Fail;
        impl Read for Fail {
            fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
                Err(io::ErrorKind::WouldBlock.into())
            }
        }
        let mut b = ReadBuf::from_vec(b"abc".to_vec());
        assert!(b.read_from(&mut Fail, 16).is_err());
        assert_eq!(&b[..], b"abc");
    }
}
