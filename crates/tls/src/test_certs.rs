//! Certificates made at test time with rcgen (feature `test-certs`): a CA of
//! its own per [`Pki`], and server and client certificates it signs, written
//! as PEM files into a fresh directory under the system's temp dir.

use rcgen::{
    date_time_ymd, BasicConstraints, Certificate, CertificateParams, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair,
};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

/// A test certificate authority and the directory its files go to.
pub struct Pki {
    pub dir: PathBuf,
    ca: Certificate,
    ca_key: KeyPair,
}

/// A certificate and its key, as PEM files.
#[derive(Clone, Debug)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

static NEXT: AtomicU32 = AtomicU32::new(0);

fn name(cn: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    dn
}

impl Pki {
    /// A new CA called `tag`, its certificate in `<dir>/ca.pem`.
    pub fn new(tag: &str) -> Pki {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("mbal-tls-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.distinguished_name = name(&format!("mbal test CA {tag}"));
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_key = KeyPair::generate().expect("CA key");
        let ca = params.self_signed(&ca_key).expect("CA certificate");
        std::fs::write(dir.join("ca.pem"), ca.pem()).expect("write CA");
        Pki { dir, ca, ca_key }
    }

    /// The CA certificate (PEM), for a peer to trust.
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    fn issue(&self, file: &str, sans: &[&str], server: bool, expired: bool) -> CertFiles {
        let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
        let mut params = CertificateParams::new(sans).expect("params");
        params.distinguished_name = name(file);
        params.extended_key_usages =
            vec![if server { ExtendedKeyUsagePurpose::ServerAuth } else { ExtendedKeyUsagePurpose::ClientAuth }];
        if expired {
            params.not_before = date_time_ymd(2000, 1, 1);
            params.not_after = date_time_ymd(2001, 1, 1);
        }
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.ca, &self.ca_key).expect("sign");
        let files = CertFiles { cert: self.dir.join(format!("{file}.pem")), key: self.dir.join(format!("{file}.key")) };
        std::fs::write(&files.cert, cert.pem()).expect("write cert");
        std::fs::write(&files.key, key.serialize_pem()).expect("write key");
        files
    }

    /// A server certificate for `localhost` and 127.0.0.1, files `<file>.pem`
    /// and `<file>.key`.
    pub fn server(&self, file: &str) -> CertFiles {
        self.issue(file, &["localhost", "127.0.0.1"], true, false)
    }

    /// A server certificate that expired in 2001.
    pub fn expired_server(&self, file: &str) -> CertFiles {
        self.issue(file, &["localhost", "127.0.0.1"], true, true)
    }

    /// A client certificate.
    pub fn client(&self, file: &str) -> CertFiles {
        self.issue(file, &["client.test"], false, false)
    }

    /// A client certificate that expired in 2001.
    pub fn expired_client(&self, file: &str) -> CertFiles {
        self.issue(file, &["client.test"], false, true)
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
