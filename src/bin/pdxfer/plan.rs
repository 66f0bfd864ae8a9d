//! `pdxfer plan`: per (prefill rank, decode rank) tokens, runs, bytes and write
//! counts, packed vs unpacked. Defaults to the worked example of the design
//! (P=64, D=4, 300 tokens, source pages [7,3,12,5,20], decode pages [40,9]).

use clap::Args;
use pdxfer::layout::{
    pairs_with_share, CpMode, CpSender, CpStorage, DcpLayout, PackLayout, PairRequest, Side,
};
use pdxfer::{Error, Result};
use serde::Serialize;

/// Arguments of `pdxfer plan`.
#[derive(Args, Debug)]
pub struct PlanArgs {
    /// Tokens in the request after the decode prefix (default: 300, the worked example).
    #[arg(long)]
    tokens: Option<u64>,
    /// Decode page size (tokens per physical page).
    #[arg(long, default_value_t = 64)]
    page_size: u64,
    /// Decode DCP size.
    #[arg(long, default_value_t = 4)]
    dcp_size: u64,
    /// Decode DCP interleave size (SGLang: 1).
    #[arg(long, default_value_t = 1)]
    interleave: u64,
    /// Prefill page size (default: the decode page size).
    #[arg(long)]
    src_page_size: Option<u64>,
    /// Prefill DCP size (SGLang supports 1 only; pdxfer any).
    #[arg(long, default_value_t = 1)]
    src_dcp_size: u64,
    /// Prefill DCP interleave size.
    #[arg(long, default_value_t = 1)]
    src_interleave: u64,
    /// Prefill page ids, comma separated (default: the worked example's, or 0,1,2,...).
    #[arg(long, value_delimiter = ',')]
    src_pages: Option<Vec<u64>>,
    /// Decode virtual page ids, comma separated (default: the worked example's, or 0,1,2,...).
    #[arg(long, value_delimiter = ',')]
    dst_pages: Option<Vec<u64>>,
    /// Tokens the decode side already holds (multiple of page_size * dcp_size).
    #[arg(long, default_value_t = 0)]
    prefix: u64,
    /// Only this decode rank.
    #[arg(long)]
    rank: Option<u64>,
    /// Bytes of one token row per layer (DeepSeek MLA bf16: 576 x 2).
    #[arg(long, default_value_t = 1152)]
    row_bytes: u64,
    /// KV entries (layers).
    #[arg(long, default_value_t = 61)]
    layers: u64,
    /// Print the first N (position, source row, destination row) of each pair.
    #[arg(long, default_value_t = 0)]
    show_rows: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Prefill attention CP size: its CP ranks hold replicated KV, and the
    /// plan is shown per sending CP rank.
    #[arg(long, default_value_t = 1)]
    src_cp_size: u64,
    /// Only this prefill CP rank (default: every one).
    #[arg(long)]
    src_cp_rank: Option<u64>,
    /// Which CP ranks send: rank0 (SGLang's default: CP rank 0 sends all) or
    /// all-cp (each CP rank its contiguous page range, SGLang's
    /// SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER).
    #[arg(long, default_value = "rank0")]
    cp_mode: String,
    /// The prefill's chunk ends (absolute positions, comma separated; each but
    /// the last on a prefill page boundary; the request's end is appended).
    #[arg(long, value_delimiter = ',')]
    chunk_ends: Option<Vec<u64>>,
}

/// One prefill rank's send: a chunk, or its CP share.
struct Send {
    cp_rank: Option<u64>,
    chunk: Option<usize>,
    /// The source pages it covers (indices into the request's).
    pages: std::ops::Range<usize>,
    origin: u64,
    start: u64,
    num_tokens: u64,
}

/// The sends of the request `n` tokens after the prefix: the whole request
/// from every prefill rank, or per chunk and CP rank their share.
fn sends(a: &PlanArgs, n: u64, src_l: &DcpLayout, src_pages: &[u64]) -> Result<Vec<Send>> {
    let mode = CpMode::parse(&a.cp_mode)?;
    if a.src_cp_size <= 1 && a.chunk_ends.is_none() && a.src_cp_rank.is_none() {
        return Ok(vec![Send {
            cp_rank: None,
            chunk: None,
            pages: 0..src_pages.len(),
            origin: a.prefix,
            start: a.prefix,
            num_tokens: n,
        }]);
    }
    if src_l.dcp_size != 1 {
        return Err(Error::invalid(
            "--src-cp-size and --chunk-ends take a prefill of --src-dcp-size 1",
        ));
    }
    let p = src_l.page_size;
    let end = a.prefix + n;
    let mut ends = a.chunk_ends.clone().unwrap_or_default();
    if ends.last() != Some(&end) {
        ends.push(end);
    }
    let mut prev = a.prefix;
    for (i, &e) in ends.iter().enumerate() {
        let last = i + 1 == ends.len();
        if e <= prev || e > end || (!last && !(e - a.prefix).is_multiple_of(p)) {
            return Err(Error::invalid(format!(
                "--chunk-ends: {e} must lie in ({prev}, {end}] and, before the last, {} plus a multiple of the page size {p}",
                a.prefix
            )));
        }
        prev = e;
    }
    let total_pages = n.div_ceil(p);
    if (src_pages.len() as u64) < total_pages {
        return Err(Error::invalid(format!(
            "the request needs {total_pages} source pages, --src-pages gives {}",
            src_pages.len()
        )));
    }
    let cp = a.src_cp_size.max(1);
    let mut out = Vec::new();
    for c in (0..cp).filter(|c| a.src_cp_rank.is_none_or(|r| r == *c)) {
        let sender = CpSender {
            cp_size: cp,
            cp_rank: c,
            mode,
            storage: CpStorage::Replicated,
        };
        let mut from = a.prefix;
        for (i, &e) in ends.iter().enumerate() {
            let off = (from - a.prefix) / p;
            let np = (e - from).div_ceil(p);
            let sh = sender.share(total_pages, p, a.prefix, off, np, e - from)?;
            if sh.num_tokens > 0 {
                let first = off as usize + sh.pages.start;
                out.push(Send {
                    cp_rank: (cp > 1).then_some(c),
                    chunk: a.chunk_ends.is_some().then_some(i),
                    pages: first..off as usize + sh.pages.end,
                    origin: sh.start,
                    start: sh.start,
                    num_tokens: sh.num_tokens,
                });
            }
            from = e;
        }
    }
    Ok(out)
}

#[derive(Serialize)]
struct PairReport {
    /// The sending prefill attention CP rank (with `--src-cp-size` > 1).
    #[serde(skip_serializing_if = "Option::is_none")]
    cp_rank: Option<u64>,
    /// The chunk's index (with `--chunk-ends`).
    #[serde(skip_serializing_if = "Option::is_none")]
    chunk: Option<usize>,
    prefill_rank: u64,
    decode_rank: u64,
    tokens: u64,
    runs_unpacked: usize,
    runs_packed: usize,
    bytes: u64,
    writes_unpacked: u64,
    writes_packed: u64,
    pack_bytes: u64,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    rows: Vec<(u64, u64, u64)>,
}

/// Runs `pdxfer plan`.
pub fn run(a: &PlanArgs) -> Result<()> {
    let worked = a.tokens.is_none() && a.src_pages.is_none() && a.dst_pages.is_none();
    let n = a.tokens.unwrap_or(300);
    let src_l = DcpLayout::new(
        a.src_page_size.unwrap_or(a.page_size),
        a.src_dcp_size,
        a.src_interleave,
    )?;
    let dst_l = DcpLayout::new(a.page_size, a.dcp_size, a.interleave)?;
    let src_pages: Vec<u64> = match (&a.src_pages, worked) {
        (Some(p), _) => p.clone(),
        (None, true) if a.src_dcp_size == 1 && a.src_page_size.is_none() => vec![7, 3, 12, 5, 20],
        _ => (0..src_l.count_owned(0, 0, n).div_ceil(src_l.page_size)).collect(),
    };
    let dst_pages: Vec<u64> = match (&a.dst_pages, worked) {
        (Some(p), _) => p.clone(),
        (None, true) if a.page_size == 64 && a.dcp_size == 4 && a.interleave == 1 => vec![40, 9],
        _ => (0..n
            .div_ceil(dst_l.virtual_page())
            .max(dst_l.count_owned(0, 0, n).div_ceil(dst_l.page_size)))
            .collect(),
    };
    let entries = vec![a.row_bytes; a.layers as usize];
    let token_bytes = a.row_bytes * a.layers;
    let mut reports = Vec::new();
    for send in sends(a, n, &src_l, &src_pages)? {
        for (pa, db) in pairs_with_share(&src_l, &dst_l) {
            if a.rank.is_some_and(|r| r != db) {
                continue;
            }
            let req = PairRequest {
                src: Side {
                    layout: src_l,
                    rank: pa,
                    pages: &src_pages[send.pages.clone()],
                    origin: send.origin,
                },
                dst: Side {
                    layout: dst_l,
                    rank: db,
                    pages: &dst_pages,
                    origin: a.prefix,
                },
                start: send.start,
                num_tokens: send.num_tokens,
            };
            let unpacked = req.runs(false)?;
            let packed = req.runs(true)?;
            let tokens: u64 = unpacked.iter().map(|r| r.len).sum();
            let mut rows = Vec::new();
            if a.show_rows > 0 {
                req.for_each_segment(|s| {
                    for i in 0..s.len {
                        if rows.len() < a.show_rows {
                            rows.push((s.pos + i, s.src_row + i, s.dst_row + i));
                        }
                    }
                })?;
            }
            reports.push(PairReport {
                cp_rank: send.cp_rank,
                chunk: send.chunk,
                prefill_rank: pa,
                decode_rank: db,
                tokens,
                runs_unpacked: unpacked.len(),
                runs_packed: packed.len(),
                bytes: tokens * token_bytes,
                writes_unpacked: unpacked.len() as u64 * a.layers,
                writes_packed: packed.len() as u64 * a.layers,
                pack_bytes: PackLayout::new(tokens, &entries)?.total_bytes,
                rows,
            });
        }
    }
    let total_tokens: u64 = reports.iter().map(|r| r.tokens).sum();
    if a.json {
        let v = serde_json::json!({
            "request": {"tokens": n, "prefix": a.prefix, "src_pages": src_pages, "dst_pages": dst_pages,
                        "row_bytes": a.row_bytes, "layers": a.layers},
            "prefill_layout": src_l, "decode_layout": dst_l,
            "src_cp_size": a.src_cp_size, "cp_mode": CpMode::parse(&a.cp_mode)?.as_str(),
            "pairs": reports,
            "total_tokens": total_tokens,
            "writes_unpacked": reports.iter().map(|r| r.writes_unpacked).sum::<u64>(),
            "writes_packed": reports.iter().map(|r| r.writes_packed).sum::<u64>(),
        });
        println!("{v}");
        return Ok(());
    }
    println!(
        "request: {n} tokens after prefix {}, prefill P={} DCP={} I={} pages {:?}, decode P={} DCP={} I={} pages {:?}, {} layers x {} B rows",
        a.prefix, src_l.page_size, src_l.dcp_size, src_l.interleave, src_pages, dst_l.page_size, dst_l.dcp_size,
        dst_l.interleave, dst_pages, a.layers, a.row_bytes
    );
    println!(
        "{:>7} {:>6} {:>8} {:>9} {:>9} {:>14} {:>12} {:>12} {:>12}",
        "prefill", "decode", "tokens", "runs", "runs", "bytes", "writes", "writes", "pack"
    );
    println!(
        "{:>7} {:>6} {:>8} {:>9} {:>9} {:>14} {:>12} {:>12} {:>12}",
        "rank", "rank", "", "unpacked", "packed", "", "unpacked", "packed", "bytes"
    );
    for r in &reports {
        if r.cp_rank.is_some() || r.chunk.is_some() {
            println!(
                "from CP rank {}, chunk {}:",
                r.cp_rank.unwrap_or(0),
                r.chunk.map_or("-".to_string(), |c| c.to_string())
            );
        }
        println!(
            "{:>7} {:>6} {:>8} {:>9} {:>9} {:>14} {:>12} {:>12} {:>12}",
            r.prefill_rank,
            r.decode_rank,
            r.tokens,
            r.runs_unpacked,
            r.runs_packed,
            r.bytes,
            r.writes_unpacked,
            r.writes_packed,
            r.pack_bytes
        );
        for (pos, s, d) in &r.rows {
            println!("          position {pos:>6}: source row {s:>8} -> destination row {d:>8}");
        }
    }
    println!(
        "total: {total_tokens} tokens, {} writes unpacked vs {} packed",
        reports.iter().map(|r| r.writes_unpacked).sum::<u64>(),
        reports.iter().map(|r| r.writes_packed).sum::<u64>()
    );
    Ok(())
}
