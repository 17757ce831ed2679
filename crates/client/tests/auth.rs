//! The routing client against a server started with -Y: with a login every
//! connection authenticates first (memcached's ASCII auth); without, the
//! server's refusal is the error.

use mbal_client::{Client, Config, Error, Login};
use mbal_server::auth::Credentials;
use mbal_server::config::Settings;
use std::sync::Arc;

#[test]
fn the_client_logs_in_on_every_connection() {
    let s = Settings {
        port: 0,
        threads: 2,
        memory_limit: 16 << 20,
        worker_port_base: Some(0),
        auth: Some(Arc::new(Credentials::parse(b"app:s3cret\n").unwrap())),
        ..Settings::default()
    };
    let srv = mbal_server::start(s).unwrap();
    let login = Login { user: "app".into(), password: "s3cret".into() };
    let mut c = Client::connect(srv.main_addr, Config { login: Some(login.clone()), ..Config::default() }).unwrap();
    // Keys on both workers: two more connections, each authenticated.
    for i in 0..50 {
        let k = format!("k{i}");
        c.set(k.as_bytes(), k.as_bytes(), 0, 0).unwrap();
        assert_eq!(c.get(k.as_bytes()).unwrap().unwrap().data, k.as_bytes());
    }
    assert_eq!(format!("{login:?}"), "Login(\"app\", ..)", "the password is not shown");
    let wrong = Login { user: "app".into(), password: "guess".into() };
    match Client::connect(srv.main_addr, Config { login: Some(wrong), ..Config::default() }) {
        Err(Error::Server { line, .. }) => assert_eq!(line, "CLIENT_ERROR authentication failure"),
        other => panic!("{:?}", other.map(|_| ())),
    }
    // Without a login, the map request is refused.
    let e = Client::connect(srv.main_addr, Config::default()).err().expect("refused").to_string();
    assert!(e.contains("CLIENT_ERROR unauthenticated"), "{e}");
    srv.shutdown();
}
