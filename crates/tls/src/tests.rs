use super::test_certs::Pki;
use super::*;
use std::net::TcpListener;

fn client_files(pki: &Pki) -> ClientTlsFiles {
    ClientTlsFiles { ca_cert: pki.ca(), ..Default::default() }
}

fn server_files(pki: &Pki, verify_mode: VerifyMode) -> ServerTlsFiles {
    let s = pki.server("server");
    ServerTlsFiles { chain_cert: s.cert, key: Some(s.key), ca_cert: Some(pki.ca()), verify_mode, tls13_only: false }
}

/// One exchange: the server side is a `Stream` reading exactly the 6 bytes
/// of "ping\r\n" (a read fills its buffer), the client a `BlockingStream`.
fn exchange(server: &ServerTls, client: &ClientTls) -> (io::Result<()>, io::Result<Vec<u8>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let conn = server.accept().unwrap();
    let t = std::thread::spawn(move || -> io::Result<()> {
        let (sock, _) = l.accept()?;
        sock.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
        let mut s = Stream::tls(conn, sock);
        let mut buf = [0u8; 6];
        let n = s.read(&mut buf)?;
        assert_eq!(&buf[..n], b"ping\r\n");
        s.write_all(b"pong\r\n")?;
        s.close_notify();
        Ok(())
    });
    let sock = TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
    let got = (|| {
        let mut c = BlockingStream::new(sock, addr, Some(client))?;
        c.write_all(b"ping\r\n")?;
        let mut out = Vec::new();
        c.read_to_end(&mut out)?;
        Ok(out)
    })();
    (t.join().unwrap(), got)
}

#[test]
fn round_trip_and_client_certificates() {
    let pki = Pki::new("unit");
    let server = ServerTls::new(server_files(&pki, VerifyMode::None)).unwrap();
    let client = ClientTls::load(&client_files(&pki)).unwrap();
    let (s, c) = exchange(&server, &client);
    s.unwrap();
    assert_eq!(c.unwrap(), b"pong\r\n");

    // Required client certificate: refused without one, served with one.
    let server = ServerTls::new(server_files(&pki, VerifyMode::Required)).unwrap();
    let (s, c) = exchange(&server, &client);
    assert!(s.is_err() && c.is_err(), "no client certificate: {s:?} {c:?}");
    let me = pki.client("me");
    let with =
        ClientTls::load(&ClientTlsFiles { cert: Some(me.cert), key: Some(me.key), ..client_files(&pki) }).unwrap();
    let (s, c) = exchange(&server, &with);
    s.unwrap();
    assert_eq!(c.unwrap(), b"pong\r\n");

    // Optional: served without a certificate.
    let server = ServerTls::new(server_files(&pki, VerifyMode::Optional)).unwrap();
    let (s, c) = exchange(&server, &client);
    s.unwrap();
    assert_eq!(c.unwrap(), b"pong\r\n");
}

#[test]
fn files_are_checked() {
    let pki = Pki::new("files");
    let s = pki.server("s");
    let other = pki.server("other");
    let bad = |f: ServerTlsFiles| ServerTls::new(f).unwrap_err();
    let base = ServerTlsFiles {
        chain_cert: s.cert.clone(),
        key: Some(s.key.clone()),
        ca_cert: None,
        verify_mode: VerifyMode::None,
        tls13_only: true,
    };
    let e = bad(ServerTlsFiles { chain_cert: pki.dir.join("missing.pem"), ..base.clone() });
    assert!(e.contains("missing.pem"), "{e}");
    let e = bad(ServerTlsFiles { key: Some(other.key.clone()), ..base.clone() });
    assert!(e.contains("usable pair"), "{e}");
    let e = bad(ServerTlsFiles { verify_mode: VerifyMode::Required, ..base.clone() });
    assert!(e.contains("ssl_ca_cert"), "{e}");
    let e = bad(ServerTlsFiles { key: Some(s.cert.clone()), ..base.clone() });
    assert!(e.contains("private key"), "{e}");
    assert_eq!(VerifyMode::from_memcached(3), Ok(VerifyMode::Required));
    assert!(VerifyMode::from_memcached(4).is_err());
    // A key in the chain file is found there.
    let both = pki.dir.join("both.pem");
    let text = std::fs::read_to_string(&s.cert).unwrap() + &std::fs::read_to_string(&s.key).unwrap();
    std::fs::write(&both, text).unwrap();
    ServerTls::new(ServerTlsFiles { chain_cert: both, key: None, ..base }).unwrap();
}
