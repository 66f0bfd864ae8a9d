//! The `repr(C)` copies of `verbs_sys` and the verbs constants of `qp`,
//! `tracker` and `handshake` against the installed `<infiniband/verbs.h>`:
//! one C program, generated from the table below, prints every `sizeof`,
//! `offsetof` and constant; each must equal the Rust value. Needs a C
//! compiler and verbs.h (Debian libibverbs-dev), which the test machines have
//! (scripts/deps.sh): without them the test fails, naming the package.

use super::handshake::Mtu;
use super::qp::{
    mask, QpState, ACCESS_LOCAL_WRITE, ACCESS_RELAXED_ORDERING, ACCESS_REMOTE_READ,
    ACCESS_REMOTE_WRITE,
};
use super::tracker::{
    wc_status_text, WC_LOC_PROT_ERR, WC_OP_RDMA_READ, WC_OP_RDMA_WRITE, WC_OP_RECV_RDMA_WITH_IMM,
    WC_RECV, WC_REM_ACCESS_ERR, WC_RETRY_EXC_ERR, WC_RNR_RETRY_EXC_ERR, WC_SUCCESS,
    WC_WR_FLUSH_ERR,
};
use super::verbs_sys::*;
use std::mem::{align_of, offset_of, size_of};

/// One C expression (printed as an unsigned 64-bit number) and the Rust value it must equal.
struct Check {
    c: String,
    rust: u64,
}

macro_rules! size {
    ($c:literal, $t:ty) => {
        Check {
            c: format!("sizeof({})", $c),
            rust: size_of::<$t>() as u64,
        }
    };
}
macro_rules! align {
    ($c:literal, $t:ty) => {
        Check {
            c: format!("_Alignof({})", $c),
            rust: align_of::<$t>() as u64,
        }
    };
}
macro_rules! off {
    ($c:literal, $cf:literal, $t:ty, $($f:tt)+) => {
        Check {
            c: format!("offsetof({}, {})", $c, $cf),
            rust: offset_of!($t, $($f)+) as u64,
        }
    };
}
macro_rules! val {
    ($c:literal, $v:expr) => {
        Check {
            c: $c.to_string(),
            rust: $v as u64,
        }
    };
}

fn checks() -> Vec<Check> {
    vec![
        // Structs passed by value or written whole by the library: sizes too.
        size!("union ibv_gid", ibv_gid),
        size!("struct ibv_device_attr", ibv_device_attr),
        size!("struct ibv_port_attr", ibv_port_attr),
        size!("struct ibv_context_ops", ibv_context_ops),
        size!("struct ibv_context", ibv_context),
        size!("struct ibv_mr", ibv_mr),
        size!("struct ibv_qp_cap", ibv_qp_cap),
        size!("struct ibv_qp_init_attr", ibv_qp_init_attr),
        size!("struct ibv_global_route", ibv_global_route),
        size!("struct ibv_ah_attr", ibv_ah_attr),
        size!("struct ibv_qp_attr", ibv_qp_attr),
        size!("struct ibv_sge", ibv_sge),
        size!("struct ibv_send_wr", ibv_send_wr),
        size!("struct ibv_recv_wr", ibv_recv_wr),
        size!("struct ibv_wc", ibv_wc),
        align!("struct ibv_send_wr", ibv_send_wr),
        align!("struct ibv_wc", ibv_wc),
        align!("struct ibv_qp_attr", ibv_qp_attr),
        // Fields pdxfer reads or writes.
        off!(
            "struct ibv_context",
            "ops.poll_cq",
            ibv_context,
            ops.poll_cq
        ),
        off!(
            "struct ibv_context",
            "ops.req_notify_cq",
            ibv_context,
            ops.req_notify_cq
        ),
        off!(
            "struct ibv_context",
            "ops.post_send",
            ibv_context,
            ops.post_send
        ),
        off!(
            "struct ibv_context",
            "ops.post_recv",
            ibv_context,
            ops.post_recv
        ),
        off!("struct ibv_context", "cmd_fd", ibv_context, cmd_fd),
        off!(
            "struct ibv_context",
            "num_comp_vectors",
            ibv_context,
            num_comp_vectors
        ),
        off!("struct ibv_cq", "context", ibv_cq, context),
        off!("struct ibv_qp", "context", ibv_qp, context),
        off!("struct ibv_qp", "qp_num", ibv_qp, qp_num),
        off!("struct ibv_mr", "length", ibv_mr, length),
        off!("struct ibv_mr", "lkey", ibv_mr, lkey),
        off!("struct ibv_mr", "rkey", ibv_mr, rkey),
        off!(
            "struct ibv_device_attr",
            "max_mr_size",
            ibv_device_attr,
            max_mr_size
        ),
        off!(
            "struct ibv_device_attr",
            "max_qp_wr",
            ibv_device_attr,
            max_qp_wr
        ),
        off!(
            "struct ibv_device_attr",
            "max_cqe",
            ibv_device_attr,
            max_cqe
        ),
        off!(
            "struct ibv_device_attr",
            "max_qp_rd_atom",
            ibv_device_attr,
            max_qp_rd_atom
        ),
        off!(
            "struct ibv_device_attr",
            "max_pkeys",
            ibv_device_attr,
            max_pkeys
        ),
        off!(
            "struct ibv_device_attr",
            "phys_port_cnt",
            ibv_device_attr,
            phys_port_cnt
        ),
        off!("struct ibv_port_attr", "state", ibv_port_attr, state),
        off!("struct ibv_port_attr", "max_mtu", ibv_port_attr, max_mtu),
        off!(
            "struct ibv_port_attr",
            "active_mtu",
            ibv_port_attr,
            active_mtu
        ),
        off!(
            "struct ibv_port_attr",
            "gid_tbl_len",
            ibv_port_attr,
            gid_tbl_len
        ),
        off!(
            "struct ibv_port_attr",
            "max_msg_sz",
            ibv_port_attr,
            max_msg_sz
        ),
        off!("struct ibv_port_attr", "lid", ibv_port_attr, lid),
        off!(
            "struct ibv_port_attr",
            "link_layer",
            ibv_port_attr,
            link_layer
        ),
        off!(
            "struct ibv_qp_init_attr",
            "send_cq",
            ibv_qp_init_attr,
            send_cq
        ),
        off!(
            "struct ibv_qp_init_attr",
            "recv_cq",
            ibv_qp_init_attr,
            recv_cq
        ),
        off!(
            "struct ibv_qp_init_attr",
            "cap.max_send_wr",
            ibv_qp_init_attr,
            cap.max_send_wr
        ),
        off!(
            "struct ibv_qp_init_attr",
            "cap.max_recv_sge",
            ibv_qp_init_attr,
            cap.max_recv_sge
        ),
        off!(
            "struct ibv_qp_init_attr",
            "qp_type",
            ibv_qp_init_attr,
            qp_type
        ),
        off!(
            "struct ibv_qp_init_attr",
            "sq_sig_all",
            ibv_qp_init_attr,
            sq_sig_all
        ),
        off!("struct ibv_qp_attr", "rq_psn", ibv_qp_attr, rq_psn),
        off!("struct ibv_qp_attr", "sq_psn", ibv_qp_attr, sq_psn),
        off!(
            "struct ibv_qp_attr",
            "dest_qp_num",
            ibv_qp_attr,
            dest_qp_num
        ),
        off!(
            "struct ibv_qp_attr",
            "qp_access_flags",
            ibv_qp_attr,
            qp_access_flags
        ),
        off!(
            "struct ibv_qp_attr",
            "ah_attr.grh.dgid",
            ibv_qp_attr,
            ah_attr.grh.dgid
        ),
        off!(
            "struct ibv_qp_attr",
            "ah_attr.grh.sgid_index",
            ibv_qp_attr,
            ah_attr.grh.sgid_index
        ),
        off!(
            "struct ibv_qp_attr",
            "ah_attr.grh.hop_limit",
            ibv_qp_attr,
            ah_attr.grh.hop_limit
        ),
        off!(
            "struct ibv_qp_attr",
            "ah_attr.grh.traffic_class",
            ibv_qp_attr,
            ah_attr.grh.traffic_class
        ),
        off!(
            "struct ibv_qp_attr",
            "ah_attr.dlid",
            ibv_qp_attr,
            ah_attr.dlid
        ),
        off!("struct ibv_qp_attr", "ah_attr.sl", ibv_qp_attr, ah_attr.sl),
        off!(
            "struct ibv_qp_attr",
            "ah_attr.is_global",
            ibv_qp_attr,
            ah_attr.is_global
        ),
        off!(
            "struct ibv_qp_attr",
            "ah_attr.port_num",
            ibv_qp_attr,
            ah_attr.port_num
        ),
        off!("struct ibv_qp_attr", "pkey_index", ibv_qp_attr, pkey_index),
        off!(
            "struct ibv_qp_attr",
            "max_rd_atomic",
            ibv_qp_attr,
            max_rd_atomic
        ),
        off!(
            "struct ibv_qp_attr",
            "max_dest_rd_atomic",
            ibv_qp_attr,
            max_dest_rd_atomic
        ),
        off!(
            "struct ibv_qp_attr",
            "min_rnr_timer",
            ibv_qp_attr,
            min_rnr_timer
        ),
        off!("struct ibv_qp_attr", "port_num", ibv_qp_attr, port_num),
        off!("struct ibv_qp_attr", "timeout", ibv_qp_attr, timeout),
        off!("struct ibv_qp_attr", "retry_cnt", ibv_qp_attr, retry_cnt),
        off!("struct ibv_qp_attr", "rnr_retry", ibv_qp_attr, rnr_retry),
        off!("struct ibv_qp_attr", "rate_limit", ibv_qp_attr, rate_limit),
        off!("struct ibv_sge", "length", ibv_sge, length),
        off!("struct ibv_sge", "lkey", ibv_sge, lkey),
        off!("struct ibv_send_wr", "next", ibv_send_wr, next),
        off!("struct ibv_send_wr", "sg_list", ibv_send_wr, sg_list),
        off!("struct ibv_send_wr", "num_sge", ibv_send_wr, num_sge),
        off!("struct ibv_send_wr", "opcode", ibv_send_wr, opcode),
        off!("struct ibv_send_wr", "send_flags", ibv_send_wr, send_flags),
        off!("struct ibv_send_wr", "imm_data", ibv_send_wr, imm_data),
        off!(
            "struct ibv_send_wr",
            "wr.rdma.remote_addr",
            ibv_send_wr,
            wr.rdma.remote_addr
        ),
        off!(
            "struct ibv_send_wr",
            "wr.rdma.rkey",
            ibv_send_wr,
            wr.rdma.rkey
        ),
        off!(
            "struct ibv_send_wr",
            "qp_type.xrc.remote_srqn",
            ibv_send_wr,
            remote_srqn
        ),
        off!("struct ibv_recv_wr", "next", ibv_recv_wr, next),
        off!("struct ibv_recv_wr", "sg_list", ibv_recv_wr, sg_list),
        off!("struct ibv_recv_wr", "num_sge", ibv_recv_wr, num_sge),
        off!("struct ibv_wc", "status", ibv_wc, status),
        off!("struct ibv_wc", "opcode", ibv_wc, opcode),
        off!("struct ibv_wc", "vendor_err", ibv_wc, vendor_err),
        off!("struct ibv_wc", "imm_data", ibv_wc, imm_data),
        off!("struct ibv_wc", "wc_flags", ibv_wc, wc_flags),
        off!("struct ibv_wc", "dlid_path_bits", ibv_wc, dlid_path_bits),
        // Constants.
        val!("IBV_QPT_RC", IBV_QPT_RC),
        val!("IBV_WR_RDMA_WRITE", IBV_WR_RDMA_WRITE),
        val!("IBV_WR_RDMA_WRITE_WITH_IMM", IBV_WR_RDMA_WRITE_WITH_IMM),
        val!("IBV_WR_RDMA_READ", IBV_WR_RDMA_READ),
        val!("IBV_SEND_SIGNALED", IBV_SEND_SIGNALED),
        val!("IBV_WC_WITH_IMM", IBV_WC_WITH_IMM),
        val!("IBV_WC_SUCCESS", IBV_WC_SUCCESS),
        val!("IBV_LINK_LAYER_ETHERNET", IBV_LINK_LAYER_ETHERNET),
        val!("IBV_QP_STATE", mask::STATE),
        val!("IBV_QP_ACCESS_FLAGS", mask::ACCESS_FLAGS),
        val!("IBV_QP_PKEY_INDEX", mask::PKEY_INDEX),
        val!("IBV_QP_PORT", mask::PORT),
        val!("IBV_QP_AV", mask::AV),
        val!("IBV_QP_PATH_MTU", mask::PATH_MTU),
        val!("IBV_QP_TIMEOUT", mask::TIMEOUT),
        val!("IBV_QP_RETRY_CNT", mask::RETRY_CNT),
        val!("IBV_QP_RNR_RETRY", mask::RNR_RETRY),
        val!("IBV_QP_RQ_PSN", mask::RQ_PSN),
        val!("IBV_QP_MAX_QP_RD_ATOMIC", mask::MAX_QP_RD_ATOMIC),
        val!("IBV_QP_MIN_RNR_TIMER", mask::MIN_RNR_TIMER),
        val!("IBV_QP_SQ_PSN", mask::SQ_PSN),
        val!("IBV_QP_MAX_DEST_RD_ATOMIC", mask::MAX_DEST_RD_ATOMIC),
        val!("IBV_QP_DEST_QPN", mask::DEST_QPN),
        val!("IBV_ACCESS_LOCAL_WRITE", ACCESS_LOCAL_WRITE),
        val!("IBV_ACCESS_REMOTE_WRITE", ACCESS_REMOTE_WRITE),
        val!("IBV_ACCESS_REMOTE_READ", ACCESS_REMOTE_READ),
        val!("IBV_ACCESS_RELAXED_ORDERING", ACCESS_RELAXED_ORDERING),
        val!("IBV_QPS_INIT", QpState::Init as u32),
        val!("IBV_QPS_RTR", QpState::Rtr as u32),
        val!("IBV_QPS_RTS", QpState::Rts as u32),
        val!("IBV_QPS_ERR", QpState::Err as u32),
        val!("IBV_MTU_256", Mtu::Mtu256.to_ibv()),
        val!("IBV_MTU_4096", Mtu::Mtu4096.to_ibv()),
        val!("IBV_WC_SUCCESS", WC_SUCCESS),
        val!("IBV_WC_LOC_PROT_ERR", WC_LOC_PROT_ERR),
        val!("IBV_WC_WR_FLUSH_ERR", WC_WR_FLUSH_ERR),
        val!("IBV_WC_REM_ACCESS_ERR", WC_REM_ACCESS_ERR),
        val!("IBV_WC_RETRY_EXC_ERR", WC_RETRY_EXC_ERR),
        val!("IBV_WC_RNR_RETRY_EXC_ERR", WC_RNR_RETRY_EXC_ERR),
        val!("IBV_WC_RECV", WC_RECV),
        val!("IBV_WC_RDMA_WRITE", WC_OP_RDMA_WRITE),
        val!("IBV_WC_RDMA_READ", WC_OP_RDMA_READ),
        val!("IBV_WC_RECV_RDMA_WITH_IMM", WC_OP_RECV_RDMA_WITH_IMM),
    ]
}

/// Completion statuses whose names `tracker::wc_status_text` gives: the C
/// program prints their values after the checks.
const WC_STATUS_NAMES: &[&str] = &[
    "IBV_WC_LOC_LEN_ERR",
    "IBV_WC_LOC_PROT_ERR",
    "IBV_WC_WR_FLUSH_ERR",
    "IBV_WC_REM_INV_REQ_ERR",
    "IBV_WC_REM_ACCESS_ERR",
    "IBV_WC_RETRY_EXC_ERR",
    "IBV_WC_RNR_RETRY_EXC_ERR",
    "IBV_WC_GENERAL_ERR",
];

/// The C program printing each check's value, then each status of
/// [`WC_STATUS_NAMES`], one per line.
fn program(checks: &[Check]) -> String {
    let mut s = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include <infiniband/verbs.h>\nint main(void) {\n",
    );
    for c in checks {
        s.push_str(&format!(
            "  printf(\"%llu\\n\", (unsigned long long)({}));\n",
            c.c
        ));
    }
    for n in WC_STATUS_NAMES {
        s.push_str(&format!(
            "  printf(\"%llu\\n\", (unsigned long long)({n}));\n"
        ));
    }
    s.push_str("  return 0;\n}\n");
    s
}

#[test]
fn rust_definitions_match_the_installed_verbs_h() {
    let checks = checks();
    let dir = std::env::temp_dir().join(format!("pdxfer-verbs-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("layout.c");
    let exe = dir.join("layout");
    std::fs::write(&src, program(&checks)).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = std::process::Command::new(&cc)
        .arg("-std=c11")
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("{cc}: {e} (a C compiler is needed to check verbs.h)"));
    assert!(
        out.status.success(),
        "compiling against <infiniband/verbs.h> failed (install Debian libibverbs-dev): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = std::process::Command::new(&exe).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(run.status.success());
    let values: Vec<u64> = String::from_utf8(run.stdout)
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(values.len(), checks.len() + WC_STATUS_NAMES.len());
    let (values, statuses) = values.split_at(checks.len());
    for (name, code) in WC_STATUS_NAMES.iter().zip(statuses) {
        assert_eq!(wc_status_text(*code as u32).0, *name, "status {code}");
    }
    let wrong: Vec<String> = checks
        .iter()
        .zip(values)
        .filter(|(c, v)| c.rust != **v)
        .map(|(c, v)| format!("{}: verbs.h {v}, Rust {}", c.c, c.rust))
        .collect();
    assert!(wrong.is_empty(), "mismatches:\n{}", wrong.join("\n"));
}
