//! `mbal bench --tls-ca ...` end to end: plain and routed modes against a real mbal server
//! listening with TLS (certificates made at test time), with and without a client certificate.

use std::net::SocketAddr;

use mbal_bench::workload::WorkloadKind;
use mbal_bench::{run, BenchArgs, TlsArgs};
use mbal_server::config::Settings;
use mbal_tls::test_certs::Pki;
use mbal_tls::{ServerTlsFiles, VerifyMode};

fn args(server: SocketAddr, routed: bool, tls: TlsArgs) -> BenchArgs {
    BenchArgs {
        server: vec![server.to_string()],
        routed,
        quiet: true,
        keys: 1000,
        load: true,
        duration: Some(30.0),
        max_ops: Some(5_000),
        conns: 4,
        threads: 2,
        pipeline: 8,
        workload: WorkloadKind::C,
        tls,
        ..BenchArgs::default()
    }
}

/// The run fails, or (a connection that fails may end its thread's share instead of the whole
/// run) nothing was served.
fn refused(a: BenchArgs) {
    if let Ok(r) = run(a) {
        assert_eq!((r.totals.ops, r.totals.hits), (0, 0), "served: {:?}", r.totals);
    }
}

#[test]
fn bench_plain_and_routed_over_tls() {
    let pki = Pki::new("bench");
    let cert = pki.server("server");
    let me = pki.client("bench");
    let s = Settings {
        port: 0,
        threads: 2,
        memory_limit: 32 << 20,
        worker_port_base: Some(0),
        tls: Some(ServerTlsFiles {
            chain_cert: cert.cert.clone(),
            key: Some(cert.key.clone()),
            ca_cert: Some(pki.ca()),
            verify_mode: VerifyMode::Required,
            tls13_only: false,
        }),
        ..Settings::default()
    };
    let srv = mbal_server::start(s).unwrap();
    let tls = TlsArgs {
        tls_ca: Some(pki.ca()),
        tls_cert: Some(me.cert.clone()),
        tls_key: Some(me.key.clone()),
        tls_server_name: Some("localhost".into()),
    };
    for routed in [false, true] {
        let r = run(args(srv.main_addr, routed, tls.clone())).unwrap();
        let t = &r.totals;
        assert_eq!((t.errors, t.unfinished, t.ops), (0, 0, 5_000), "routed={routed}: {t:?}");
        assert!(t.hits > 0, "{t:?}");
    }
    // Without the client certificate the server refuses the bench.
    let no_cert = TlsArgs { tls_cert: None, tls_key: None, ..tls.clone() };
    refused(BenchArgs { load: false, ..args(srv.main_addr, false, no_cert) });
    // Without --tls-ca the bench speaks plaintext, which a TLS port does not answer.
    // (No load phase: it would wait out --load-timeout for replies that never come.)
    let plaintext = BenchArgs { load: false, ..args(srv.main_addr, false, TlsArgs::default()) };
    refused(plaintext);
    srv.shutdown();
}
