#![no_main]
use libfuzzer_sys::fuzz_target;
use mbal_proto::Protocol;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    // Force the binary magic on the first request.
    let mut buf = data.to_vec();
    if buf.len() > 1 {
        buf[1] = 0x80;
    }
    common::drive(Protocol::Binary, &buf);
});
