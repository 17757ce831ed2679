#![no_main]
//! The cluster map's JSON (`mbal map`, the coordinator's state): any text is a map or an
//! error, never a panic, and a map read writes back to itself; the VN table's plain-form
//! reader answers only where serde_json reads the same numbers.
use libfuzzer_sys::fuzz_target;
use mbal_cluster::{parse_u32_array, ClusterMap};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Some(v) = parse_u32_array(text) {
        let serde: Vec<u32> = serde_json::from_str(text).expect("plain form is JSON");
        assert_eq!(serde, v);
    }
    if let Ok(m) = ClusterMap::from_json(text) {
        assert_eq!(ClusterMap::from_json(&m.to_json()).expect("its own JSON"), m);
    }
});
