#![no_main]
use libfuzzer_sys::fuzz_target;
use mbal_proto::Protocol;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    common::drive(Protocol::Text, data);
});
