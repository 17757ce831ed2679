//! `migbench-keys VN_TABLE CACHELET COUNT PREFIX`: prints the first COUNT indices `i` such that
//! the key `PREFIX{i}` falls in CACHELET, one per line. VN_TABLE is a file with the map's
//! `layout.vn_to_cachelet`, one cachelet id per line (its length is the VN count). The route is
//! mbal's (`mbal_cluster::key_hash` = xxh3-64 of the key; VN = (hash >> 32) % vn_count).

use std::io::Write;

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 5 {
        eprintln!("usage: migbench-keys VN_TABLE CACHELET COUNT PREFIX");
        std::process::exit(2);
    }
    let table: Vec<u32> = std::fs::read_to_string(&a[1])
        .expect("reading the VN table")
        .split_whitespace()
        .map(|s| s.parse().expect("a cachelet id"))
        .collect();
    let c: u32 = a[2].parse().expect("CACHELET");
    let want: u64 = a[3].parse().expect("COUNT");
    let prefix = a[4].as_bytes();
    let n = table.len() as u64;
    assert!(n > 0 && table.contains(&c), "cachelet {c} has no VN");
    let out = std::io::stdout();
    let mut out = std::io::BufWriter::with_capacity(1 << 20, out.lock());
    let mut key = Vec::with_capacity(prefix.len() + 20);
    let (mut found, mut i) = (0u64, 0u64);
    while found < want {
        key.clear();
        key.extend_from_slice(prefix);
        key.extend_from_slice(i.to_string().as_bytes());
        let h = xxhash_rust::xxh3::xxh3_64(&key);
        if table[((h >> 32) % n) as usize] == c {
            writeln!(out, "{i}").expect("stdout");
            found += 1;
        }
        i += 1;
    }
}
