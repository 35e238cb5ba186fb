//! A test certificate authority made with the `openssl` command: a CA, a server certificate it
//! signs for 127.0.0.1, and a second CA nobody trusts.

use std::path::Path;
use std::process::Command;

use crate::stderr;

/// Runs `openssl ARGS` in `dir`; panics with its error output when it fails.
pub fn openssl(args: &[&str], dir: &Path) {
    let o = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "openssl {args:?}: {}", stderr(&o));
}

fn self_signed_ca(dir: &Path, cn: &str, key: &str, cert: &str) {
    let subj = format!("/CN={cn}");
    let args = [
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", &subj,
    ];
    openssl(&[&args[..], &["-keyout", key, "-out", cert]].concat(), dir);
}

/// In `dir`: `ca.pem` (+ `ca.key`), `server.pem` and `server.key` signed by it for IP 127.0.0.1,
/// and `other.pem` (+ `other.key`), a CA that signed nothing of ours.
pub fn test_ca(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    self_signed_ca(dir, "kestrel-test-ca", "ca.key", "ca.pem");
    openssl(
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ],
        dir,
    );
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    openssl(
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            "-out",
            "server.pem",
        ],
        dir,
    );
    self_signed_ca(dir, "other-ca", "other.key", "other.pem");
}

/// In `dir` (after [`test_ca`]): `{cn}.pem` and `{cn}.key`, a client certificate for `cn`
/// signed by `ca.pem` (what a broker that authenticates clients by certificate checks; with
/// Mosquitto's `use_identity_as_username`, `cn` is the client's user name).
pub fn client_cert(dir: &Path, cn: &str) {
    let (key, csr, pem) = (
        format!("{cn}.key"),
        format!("{cn}.csr"),
        format!("{cn}.pem"),
    );
    let subj = format!("/CN={cn}");
    openssl(
        &[
            "req", "-newkey", "rsa:2048", "-nodes", "-subj", &subj, "-keyout", &key, "-out", &csr,
        ],
        dir,
    );
    std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
    openssl(
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "client.ext",
            "-out",
            &pem,
        ],
        dir,
    );
}
