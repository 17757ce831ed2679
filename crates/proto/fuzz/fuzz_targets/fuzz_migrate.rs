#![no_main]
//! The migration frame decoder (`mbal import data`, `mbal_store::wire`): any bytes decode or
//! fail cleanly, and what decodes encodes back to the same bytes.
use libfuzzer_sys::fuzz_target;
use mbal_store::wire::{decode, encode};

fuzz_target!(|data: &[u8]| {
    if let Ok(recs) = decode(data, 1 << 16) {
        let mut back = Vec::new();
        for r in &recs {
            encode(r, &mut back);
        }
        assert_eq!(back, data);
    }
});
