//! tcp between two network namespaces joined by a veth pair (a two-host
//! test on one machine). Where `ip netns add` is not allowed the skip is
//! recorded ([`common::skip`]). The namespaces are removed even on failure.

use crate::support as common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip`: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Deletes the namespaces (and with them the veth pair) when dropped.
struct Namespaces(Vec<String>);

impl Drop for Namespaces {
    fn drop(&mut self) {
        for n in &self.0 {
            let _ = ip(&["netns", "del", n]);
        }
    }
}

const SECRET: &str = "netns-test-cluster-secret-0123456789";

/// The target refuses a non-loopback listener when no secret is configured.
fn refused_without_secret() {
    let out = Command::new(env!("CARGO_BIN_EXE_pdxfer"))
        .args(["target", "--listen", "0.0.0.0:0", "--size", "4096"])
        .env_remove(pdxfer::transport::CLUSTER_SECRET_ENV)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("auth_required") || text.contains("cluster secret"),
        "{text}"
    );
}

#[test]
fn tcp_between_two_network_namespaces() {
    // Without the secret the target refuses to listen on the veth address.
    refused_without_secret();
    let id = std::process::id() % 100_000;
    let (a, b) = (format!("pdxA{id}"), format!("pdxB{id}"));
    if let Err(e) = ip(&["netns", "add", &a]) {
        common::skip("netns", &e);
        return;
    }
    let mut ns = Namespaces(vec![a.clone()]);
    ip(&["netns", "add", &b]).unwrap();
    ns.0.push(b.clone());
    let (va, vb) = (format!("pva{id}"), format!("pvb{id}"));
    let net = format!("10.{}.{}", 200 + (id % 50), (id / 50) % 250);
    let (ipa, ipb) = (format!("{net}.1"), format!("{net}.2"));
    ip(&[
        "link", "add", &va, "netns", &a, "type", "veth", "peer", "name", &vb, "netns", &b,
    ])
    .unwrap();
    for (n, v, addr) in [(&a, &va, &ipa), (&b, &vb, &ipb)] {
        ip(&["-n", n, "addr", "add", &format!("{addr}/30"), "dev", v]).unwrap();
        ip(&["-n", n, "link", "set", v, "up"]).unwrap();
        ip(&["-n", n, "link", "set", "lo", "up"]).unwrap();
    }
    let exe = env!("CARGO_BIN_EXE_pdxfer");
    let size = 1u64 << 20;
    let mut target = Command::new("ip")
        .args([
            "netns",
            "exec",
            &a,
            exe,
            "target",
            "--listen",
            &format!("{ipa}:0"),
            "--size",
            &size.to_string(),
        ])
        // a listener other hosts can reach needs the cluster secret
        .env(pdxfer::transport::CLUSTER_SECRET_ENV, SECRET)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(target.stdout.take().unwrap()).lines();
    let ready: serde_json::Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    let addr = ready["addr"].as_str().unwrap().to_string();
    assert!(addr.starts_with(&ipa), "{addr}");
    // The initiator runs in the other namespace: it reaches the target only over the veth.
    let bench = Command::new("ip")
        .args([
            "netns",
            "exec",
            &b,
            exe,
            "bench",
            "--transport",
            "tcp",
            "--connect",
            &addr,
            "--block-sizes",
            "64K",
            "--batch-sizes",
            "4",
            "--threads",
            "2",
            "--iters",
            "20",
            "--max-ms",
            "500",
            "--checksum",
            "--json",
        ])
        .env(pdxfer::transport::CLUSTER_SECRET_ENV, SECRET)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&bench.stdout);
    assert!(
        bench.status.success(),
        "bench failed: {stdout} {}",
        String::from_utf8_lossy(&bench.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(v["transport"], "tcp");
    assert!(v["gb_per_s"].as_f64().unwrap() > 0.0, "{v}");
    // Every byte the bench wrote (4 blocks of 64 KiB, pattern i*31+7) landed.
    let dump = std::env::temp_dir().join(format!("pdxfer-netns-{id}"));
    let mut stdin = target.stdin.take().unwrap();
    writeln!(stdin, "dump {}", dump.display()).unwrap();
    stdin.flush().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    for l in lines.by_ref() {
        if l.unwrap().contains("dumped") || std::time::Instant::now() > deadline {
            break;
        }
    }
    let mem = std::fs::read(&dump).unwrap();
    let _ = std::fs::remove_file(&dump);
    for (i, &byte) in mem.iter().enumerate().take(4 << 16) {
        assert_eq!(byte, (i as u64 * 31 + 7) as u8, "byte {i}");
    }
    assert!(mem[4 << 16..].iter().all(|&x| x == 0));
    drop(stdin);
    let _ = target.kill();
    let _ = target.wait();
    drop(ns);
    assert!(
        ip(&["netns", "exec", &a, "true"]).is_err(),
        "namespace {a} was not removed"
    );
}
