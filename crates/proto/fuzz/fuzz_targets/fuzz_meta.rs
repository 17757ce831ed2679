#![no_main]
use libfuzzer_sys::fuzz_target;
use mbal_proto::Protocol;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    // Force meta commands: prefix "m" so the line starts like mg/ms/md/ma/mn/me.
    let mut buf = Vec::with_capacity(data.len() + 2);
    buf.push(data.first().copied().unwrap_or(0));
    buf.push(b'm');
    buf.extend_from_slice(data.get(1..).unwrap_or(&[]));
    common::drive(Protocol::Text, &buf);
});
