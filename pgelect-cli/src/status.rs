//! `pgelect status`: who leads each role, and who stands.

use std::io::{IsTerminal, Write};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Args;
use pgelect::admin::HeldLockKind;

use crate::cli::Global;
use crate::exit::{self, Failure};

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Only this role.
    #[arg(long, value_name = "ROLE")]
    pub role: Option<String>,
    /// Print stable JSON (one object) instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Keep redrawing when leadership changes (and each second, for the
    /// lease countdown); stop with Ctrl-C.
    #[arg(long)]
    pub watch: bool,
    /// Show the assignment of partition group GROUP of N partitions (roles
    /// GROUP/0 … GROUP/N-1): the live members, the partitions each leads,
    /// those unled.
    #[arg(long, value_name = "GROUP:N", conflicts_with_all = ["role", "watch"])]
    pub partitions: Option<String>,
}

/// Parses `GROUP:N` (the last `:` separates).
pub(crate) fn parse_partitions(spec: &str) -> Result<(String, u32), Failure> {
    let bad = |why: &str| {
        Failure::new(
            exit::USAGE,
            format!(
                "invalid --partitions \"{}\": {why}; expected GROUP:N, e.g. orders:12",
                escape(spec)
            ),
        )
    };
    let (group, n) = spec.rsplit_once(':').ok_or_else(|| bad("no ':N'"))?;
    let n: u32 = n.parse().map_err(|_| bad("N is not a whole number"))?;
    if n == 0 || n > pgelect::partitions::MAX_PARTITIONS {
        return Err(bad(&format!(
            "N must be 1 to {}",
            pgelect::partitions::MAX_PARTITIONS
        )));
    }
    if group.is_empty() || group.contains(['/', '\0']) {
        return Err(bad("the group name must be non-empty, without '/' or NUL"));
    }
    let longest = pgelect::partitions::partition_role(group, n - 1);
    if longest.len() > pgelect::election::MAX_ROLE_BYTES {
        return Err(bad(&format!(
            "role {:?} would be longer than {} bytes",
            escape(&longest),
            pgelect::election::MAX_ROLE_BYTES
        )));
    }
    Ok((group.to_owned(), n))
}

/// A partition group's assignment as JSON: every partition's role, holder
/// and term, the live members with the partitions each leads, the unled
/// ones, and the share `⌈N/M⌉`.
fn partitions_json(a: &pgelect::partitions::PartitionAssignment) -> serde_json::Value {
    let n = a.partitions.len();
    let share = n.div_ceil(a.members.len().max(1));
    serde_json::json!({
        "group": a.group,
        "partitions": n,
        "members": a.members,
        "share": share,
        "by_member": a.by_member(),
        "unled": unled(a),
        "assignment": a.partitions.iter().enumerate().map(|(p, l)| serde_json::json!({
            "partition": p,
            "role": l.role,
            "holder": l.holder,
            "term": l.term.map(|t| t.get()),
        })).collect::<Vec<_>>(),
    })
}

fn unled(a: &pgelect::partitions::PartitionAssignment) -> Vec<usize> {
    a.partitions
        .iter()
        .enumerate()
        .filter(|(_, l)| l.holder.is_none())
        .map(|(p, _)| p)
        .collect()
}

fn partitions_table(a: &pgelect::partitions::PartitionAssignment) -> String {
    let n = a.partitions.len();
    let m = a.members.len();
    let mut out = format!(
        "partition group {}: {n} partitions, {m} live member{}, share {}\n",
        escape(&a.group),
        if m == 1 { "" } else { "s" },
        n.div_ceil(m.max(1))
    );
    let by = a.by_member();
    let width = by
        .keys()
        .map(|k| escape(k).chars().count())
        .max()
        .unwrap_or(0)
        .max(6);
    out.push_str(&format!(
        "{:width$}  {:>5}  PARTITIONS\n",
        "MEMBER", "COUNT"
    ));
    for (member, ps) in &by {
        let list: Vec<String> = ps.iter().map(u32::to_string).collect();
        out.push_str(&format!(
            "{:width$}  {:>5}  {}\n",
            escape(member),
            ps.len(),
            list.join(" ")
        ));
    }
    let unled = unled(a);
    if !unled.is_empty() {
        let list: Vec<String> = unled.iter().map(usize::to_string).collect();
        out.push_str(&format!("unled: {}\n", list.join(" ")));
    }
    out
}

/// One role as `status` shows it: the library's row
/// ([`pgelect::admin::RoleStatus`]) in the terms of the table and JSON.
#[derive(Debug, Clone, PartialEq)]
struct RoleStatus {
    role: String,
    holder: Option<String>,
    term: i64,
    backend: Option<String>,
    acquired_at: Option<String>,
    lease_remaining_ms: Option<i64>,
    candidates: Vec<Candidate>,
    /// Backends holding the role's lock that are not the leader its lease
    /// row names: another user (or a stray session) took the public key.
    squatters: Vec<Squatter>,
}

impl From<&pgelect::admin::RoleStatus> for RoleStatus {
    fn from(r: &pgelect::admin::RoleStatus) -> RoleStatus {
        RoleStatus {
            role: r.role.clone(),
            holder: r.holder.clone(),
            term: r.term.get(),
            backend: r.backend.clone(),
            acquired_at: r.acquired_at.map(utc),
            lease_remaining_ms: r.lease_remaining_ms,
            candidates: r
                .candidates
                .iter()
                .map(|c| Candidate {
                    node: c.node.clone(),
                    backend_pid: c.backend_pid,
                    client_addr: c.client_addr.clone(),
                    state: c.state.as_str().to_owned(),
                    priority: c.priority,
                    timing: c.timing.clone(),
                })
                .collect(),
            squatters: r
                .squatters
                .iter()
                .map(|q| Squatter {
                    pid: q.pid,
                    user: q.user.clone(),
                    application_name: q.application_name.clone(),
                    client_addr: q.client_addr.clone(),
                })
                .collect(),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Squatter {
    pid: i32,
    user: Option<String>,
    application_name: String,
    client_addr: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
struct Candidate {
    node: String,
    /// The server process serving its connection (`pg_stat_activity.pid`),
    /// not the candidate's own process id; `None` for a lease-backend
    /// candidate, which holds no connection.
    backend_pid: Option<i32>,
    /// The candidate's address as the server sees it; `None` over a Unix
    /// socket or when this user may not see it.
    client_addr: Option<String>,
    state: String,
    /// Its priority, from the candidate registry; `None` if it did not
    /// register (a pgelect older than schema 5).
    priority: Option<i32>,
    /// The timing it runs with (milliseconds), from the registry.
    timing: Option<serde_json::Value>,
}

/// An advisory lock taken by `pgelect lock` (or a library `LockSession`
/// with its default name), held or waited for, as `status` shows it.
#[derive(Debug, Clone, PartialEq)]
struct HeldLock {
    /// The lock's name as `pgelect lock` recorded it (cut at 40
    /// characters); `None` for a library session, which records no name.
    name: Option<String>,
    /// The key, `pgelect.key(name)`.
    key: i64,
    node: Option<String>,
    client_addr: Option<String>,
    backend_pid: i32,
    mode: String,
    granted: bool,
    /// When the holder took it (its session went idle then), UTC.
    since: Option<String>,
    /// A lock, or a semaphore's permit or queue (`pgelect lock --limit`).
    kind: HeldLockKind,
}

impl From<&pgelect::admin::HeldLock> for HeldLock {
    fn from(l: &pgelect::admin::HeldLock) -> HeldLock {
        HeldLock {
            name: l.name.clone(),
            key: match l.key {
                pgelect::LockKey::Single(k) => k,
                pgelect::LockKey::Pair(a, b) => ((a as i64) << 32) | (b as u32 as i64),
            },
            node: l.node.clone(),
            client_addr: l.client_addr.clone(),
            backend_pid: l.backend_pid,
            mode: match l.mode {
                pgelect::lock::LockMode::Shared => "shared",
                pgelect::lock::LockMode::Exclusive => "exclusive",
            }
            .to_owned(),
            granted: l.granted,
            since: l.since.map(utc),
            kind: l.kind,
        }
    }
}

/// A time on the server's clock as `status` prints it:
/// `2026-11-25T21:00:00.000Z` (UTC, milliseconds).
pub(crate) fn utc(t: SystemTime) -> String {
    let ms = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_millis() as i64,
        Err(e) => -(e.duration().as_millis() as i64),
    };
    let (days, ms_of_day) = (ms.div_euclid(86_400_000), ms.rem_euclid(86_400_000));
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        ms_of_day / 3_600_000,
        ms_of_day / 60_000 % 60,
        ms_of_day / 1000 % 60,
        ms_of_day % 1000
    )
}

/// The roles (one, or every one) as shown. One role the schema does not
/// know is the library's [`pgelect::Error::UnknownRole`] (exit 66).
async fn read(
    admin: &pgelect::admin::AdminClient,
    role: Option<&str>,
) -> Result<Vec<RoleStatus>, Failure> {
    let roles = match role {
        Some(role) => vec![admin.role(role).await?],
        None => admin.roles().await?,
    };
    Ok(roles.iter().map(RoleStatus::from).collect())
}

/// The locks of named lock sessions, as shown: with the whole picture
/// only, since they belong to no role.
async fn read_locks(
    admin: &pgelect::admin::AdminClient,
    role: Option<&str>,
) -> Result<Vec<HeldLock>, Failure> {
    match role {
        Some(_) => Ok(Vec::new()),
        None => Ok(admin
            .held_locks()
            .await?
            .iter()
            .map(HeldLock::from)
            .collect()),
    }
}

fn to_json(roles: &[RoleStatus], locks: &[HeldLock]) -> serde_json::Value {
    let roles: Vec<serde_json::Value> = roles
        .iter()
        .map(|r| {
            serde_json::json!({
                "role": r.role,
                "holder": r.holder,
                "term": r.term,
                "backend": r.backend,
                "acquired_at": r.acquired_at,
                "lease_remaining_ms": r.lease_remaining_ms,
                "lease_expired": r.lease_remaining_ms.map(|ms| ms < 0),
                "candidates": r.candidates.iter().map(|c| serde_json::json!({
                    "node": c.node, "backend_pid": c.backend_pid,
                    "client_addr": c.client_addr, "state": c.state,
                    "priority": c.priority, "timing": c.timing,
                })).collect::<Vec<_>>(),
                "squatters": r.squatters.iter().map(|q| serde_json::json!({
                    "backend_pid": q.pid, "user": q.user, "application_name": q.application_name,
                    "client_addr": q.client_addr,
                    "claims_pgelect": q.application_name.starts_with("pgelect:"),
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    let locks: Vec<serde_json::Value> = locks
        .iter()
        .map(|l| {
            serde_json::json!({
                "name": l.name, "key": l.key, "node": l.node,
                "client_addr": l.client_addr, "backend_pid": l.backend_pid,
                "mode": l.mode, "state": if l.granted { "holding" } else { "waiting" },
                "since": l.since,
                "permit": match l.kind {
                    HeldLockKind::Permit(slot) => serde_json::json!({ "slot": slot }),
                    HeldLockKind::PermitQueue => serde_json::json!({ "queue": true }),
                    _ => serde_json::Value::Null,
                },
            })
        })
        .collect();
    serde_json::json!({ "roles": roles, "locks": locks })
}

/// The locks section of the table: one line per holder or waiter.
fn locks_table(locks: &[HeldLock]) -> String {
    if locks.is_empty() {
        return String::new();
    }
    let mut out = String::from("\nLOCKS (pgelect lock)\n");
    for l in locks {
        let name = l.name.as_deref().map_or_else(
            || format!("key {}", l.key),
            |n| format!("\"{}\"", escape(n)),
        );
        let node = l
            .node
            .as_deref()
            .map_or_else(|| "a library LockSession".to_owned(), escape);
        let host = l
            .client_addr
            .as_deref()
            .map_or_else(|| "local socket".to_owned(), escape);
        let since = l
            .since
            .as_deref()
            .map(|s| format!(", since {s}"))
            .unwrap_or_default();
        let (name, state) = match (l.kind, l.granted) {
            (HeldLockKind::Permit(slot), _) => (format!("{name} permit {slot}"), "held"),
            (HeldLockKind::PermitQueue, true) => {
                (format!("{name} permits"), "waited for (first in line)")
            }
            (HeldLockKind::PermitQueue, false) => (format!("{name} permits"), "waited for"),
            (_, true) => (name, "held"),
            (_, false) => (name, "waited for"),
        };
        out.push_str(&format!(
            "{name}: {state} by {node} (host {host}, backend pid {}, {}{since})\n",
            l.backend_pid, l.mode
        ));
    }
    out
}

fn to_table(roles: &[RoleStatus], locks: &[HeldLock]) -> String {
    if roles.is_empty() {
        return format!(
            "no roles yet: nothing has stood for election in this schema\n{}",
            locks_table(locks)
        );
    }
    let header = [
        "ROLE",
        "LEADER",
        "TERM",
        "SINCE (UTC)",
        "LEASE LEFT",
        "CANDIDATES",
    ];
    let mut rows: Vec<[String; 6]> = Vec::new();
    for r in roles {
        let lease = match r.lease_remaining_ms {
            None => "-".to_owned(),
            Some(ms) if ms < 0 => format!("expired {:.1}s ago", -ms as f64 / 1000.0),
            Some(ms) => format!("{:.1}s", ms as f64 / 1000.0),
        };
        let waiting = r.candidates.iter().filter(|c| c.state != "holding").count();
        let candidates = if r.candidates.is_empty() {
            "none connected".to_owned()
        } else {
            // The holder is not one of those standing by: name it apart.
            let named = |holding: bool| -> Vec<String> {
                r.candidates
                    .iter()
                    .filter(|c| (c.state == "holding") == holding)
                    .map(|c| match c.priority {
                        Some(p) if p != 0 => {
                            format!("{} ({}, priority {p})", escape(&c.node), c.state)
                        }
                        _ => format!("{} ({})", escape(&c.node), c.state),
                    })
                    .collect()
            };
            let (holders, standbys) = (named(true), named(false));
            match (holders.is_empty(), waiting) {
                (_, 0) => holders.join(", "),
                (true, n) => format!("{n} standing by: {}", standbys.join(", ")),
                (false, n) => format!(
                    "{}; {n} standing by: {}",
                    holders.join(", "),
                    standbys.join(", ")
                ),
            }
        };
        let candidates = match r.squatters.len() {
            0 => candidates,
            n => format!("lock squatted ({n}, see below); {candidates}"),
        };
        rows.push([
            escape(&r.role),
            r.holder
                .as_deref()
                .map(escape)
                .unwrap_or_else(|| "(none)".to_owned()),
            r.term.to_string(),
            r.acquired_at
                .as_deref()
                .map(escape)
                .unwrap_or_else(|| "-".to_owned()),
            lease,
            candidates,
        ]);
    }
    let mut widths = header.map(|h| h.chars().count());
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row.iter()) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let line = |cells: Vec<&str>, out: &mut String| {
        let mut parts = Vec::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                parts.push(c.to_string());
            } else {
                parts.push(format!("{c:<width$}", width = widths[i]));
            }
        }
        out.push_str(parts.join("  ").trim_end());
        out.push('\n');
    };
    line(header.to_vec(), &mut out);
    for row in &rows {
        line(row.iter().map(String::as_str).collect(), &mut out);
    }
    for r in roles {
        for q in &r.squatters {
            out.push_str(&format!(
                "WARNING: role {} is blocked: its lock is held by {}, which is not the leader its lease row names{}; no candidate can take over until that session lets go. Advisory keys are database-wide: end it with pg_terminate_backend({}) and isolate pgelect (see the book's security chapter, docs/src/security.md)\n",
                escape(&r.role),
                describe(q),
                if q.application_name.starts_with("pgelect:") {
                    " (its application_name claims pgelect, which any client can set)"
                } else {
                    ""
                },
                q.pid
            ));
        }
    }
    out.push_str(&locks_table(locks));
    out
}

/// `pid 4242 (user "mallory", application "psql", from 10.0.0.7)`, escaped.
fn describe(q: &Squatter) -> String {
    let mut s = format!(
        "pid {} (user {}, application \"{}\"",
        q.pid,
        q.user
            .as_deref()
            .map_or_else(|| "unknown".to_owned(), |u| format!("\"{}\"", escape(u))),
        escape(&q.application_name)
    );
    if let Some(addr) = &q.client_addr {
        s.push_str(&format!(", from {}", escape(addr)));
    }
    s.push(')');
    s
}

/// True for characters that must not reach a terminal raw: C0 controls
/// (ESC among them), DEL, C1 controls (a lone CSI, U+009B, starts an escape
/// sequence on some terminals), and the bidirectional overrides and
/// isolates that reorder what is shown.
fn is_unsafe(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// Text from the database as it may be shown on a terminal: every unsafe
/// character written as `\u{1b}` (Rust's escape form), backslashes doubled
/// so that an escape cannot be faked.
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c == '\\' {
            out.push_str("\\\\");
        } else if is_unsafe(c) {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

/// JSON whose strings carry no unsafe character raw: serde_json escapes C0
/// controls but writes DEL, C1 controls and bidirectional marks as they are;
/// those are written as `\uXXXX` escapes (valid JSON, same value when
/// parsed). They can only occur inside strings.
fn json_text(value: &serde_json::Value) -> String {
    let raw = value.to_string();
    let mut out = String::with_capacity(raw.len());
    for c in raw.chars() {
        if is_unsafe(c) {
            out.push_str(&format!("\\u{:04x}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

/// `roles` with the lease countdown reduced to whether the lease expired:
/// what counts as a change for `--watch` on a pipe.
fn without_countdown(roles: &[RoleStatus]) -> Vec<RoleStatus> {
    roles
        .iter()
        .map(|r| RoleStatus {
            lease_remaining_ms: r.lease_remaining_ms.map(|ms| if ms < 0 { -1 } else { 1 }),
            ..r.clone()
        })
        .collect()
}

/// The server `status` read ([`pgelect::admin::ServerInfo`]): with
/// several hosts in the URL, the one it reached, which is where the
/// candidates it lists are connected.
struct Server(pgelect::admin::ServerInfo);

impl Server {
    fn line(&self) -> String {
        let timeline = self
            .0
            .timeline
            .map(|t| format!(", timeline {t}"))
            .unwrap_or_default();
        format!(
            "server {} ({}{timeline}, PostgreSQL {})\n",
            escape(&self.0.addr),
            self.0.kind(),
            escape(&self.0.version)
        )
    }

    fn json(&self) -> serde_json::Value {
        let s = &self.0;
        serde_json::json!({
            "addr": s.addr, "kind": s.kind(), "in_recovery": s.in_recovery,
            "read_only": s.read_only, "timeline": s.timeline, "version": s.version,
        })
    }
}

/// [`render`], headed by the server it was read from.
fn render_from(server: &Server, roles: &[RoleStatus], locks: &[HeldLock], json: bool) -> String {
    if json {
        let mut v = to_json(roles, locks);
        v["server"] = server.json();
        format!("{}\n", json_text(&v))
    } else {
        format!("{}{}", server.line(), to_table(roles, locks))
    }
}

#[cfg(test)]
fn render(roles: &[RoleStatus], locks: &[HeldLock], json: bool) -> String {
    if json {
        format!("{}\n", json_text(&to_json(roles, locks)))
    } else {
        to_table(roles, locks)
    }
}

/// The status table of `role` (or every role), for the demo.
pub async fn snapshot(
    options: &pgelect::ConnectOptions,
    role: Option<&str>,
) -> Result<String, Failure> {
    let admin = pgelect::admin::AdminClient::connect(options).await?;
    let roles = read(&admin, role).await?;
    Ok(to_table(&roles, &[]))
}

pub async fn run(global: &Global, args: StatusArgs) -> Result<u8, Failure> {
    let options = global.connect_options()?;
    if let Some(role) = &args.role {
        crate::run::check_name("--role", role)?;
    }
    if let Some(spec) = &args.partitions {
        let (group, n) = parse_partitions(spec)?;
        let a = pgelect::partitions::partition_assignment(&options, &group, n).await?;
        if args.json {
            println!("{}", json_text(&partitions_json(&a)));
        } else {
            print!("{}", partitions_table(&a));
        }
        return Ok(0);
    }
    let mut admin = pgelect::admin::AdminClient::connect(&options).await?;
    let role = args.role.as_deref();
    if !args.watch {
        let roles = read(&admin, role).await?;
        let locks = read_locks(&admin, role).await?;
        let server = Server(admin.server().await?);
        print!("{}", render_from(&server, &roles, &locks, args.json));
        return Ok(0);
    }
    let tty = std::io::stdout().is_terminal() && !args.json;
    let mut signals = crate::signals::Signals::install()?;
    let mut last: Option<(Vec<RoleStatus>, Vec<HeldLock>)> = None;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        let roles = read(&admin, role).await?;
        let locks = read_locks(&admin, role).await?;
        let server = Server(admin.server().await?);
        let mut stdout = std::io::stdout().lock();
        if tty {
            // Home, draw, clear what is left: no blank frame, no flicker.
            let text = render_from(&server, &roles, &locks, args.json);
            let _ = write!(stdout, "\x1b[H{}\x1b[J", text.replace('\n', "\x1b[K\n"));
        } else {
            // A pipe gets a snapshot per change, not per tick: the lease
            // countdown alone would print one every second.
            let seen = Some((without_countdown(&roles), locks.clone()));
            if seen != last {
                let _ = write!(
                    stdout,
                    "{}",
                    render_from(&server, &roles, &locks, args.json)
                );
                last = seen;
            }
        }
        let _ = stdout.flush();
        drop(stdout);
        tokio::select! {
            _ = tick.tick() => {}
            changed = admin.changed() => changed?,
            _ = signals.recv() => return Ok(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_specs_parse_or_say_what_is_wrong() {
        assert_eq!(
            parse_partitions("orders:12").unwrap(),
            ("orders".into(), 12)
        );
        assert_eq!(parse_partitions("a:b:3").unwrap(), ("a:b".into(), 3));
        for (bad, needle) in [
            ("orders", "no ':N'"),
            ("orders:x", "whole number"),
            ("orders:0", "1 to 4096"),
            ("orders:5000", "1 to 4096"),
            (":3", "non-empty"),
            ("a/b:3", "without '/'"),
        ] {
            let e = parse_partitions(bad).unwrap_err();
            assert_eq!(e.code, exit::USAGE);
            assert!(e.message.contains(needle), "{bad}: {}", e.message);
        }
    }

    fn sample() -> Vec<RoleStatus> {
        vec![RoleStatus {
            role: "scheduler".into(),
            holder: Some("node-a".into()),
            term: 7,
            backend: Some("session".into()),
            acquired_at: Some("2026-11-25T21:00:00.000Z".into()),
            lease_remaining_ms: Some(4200),
            squatters: vec![],
            candidates: vec![
                Candidate {
                    node: "node-a".into(),
                    backend_pid: Some(10),
                    client_addr: None,
                    state: "holding".into(),
                    priority: Some(0),
                    timing: None,
                },
                Candidate {
                    node: "node-b".into(),
                    backend_pid: Some(11),
                    client_addr: None,
                    state: "waiting".into(),
                    priority: Some(10),
                    timing: Some(serde_json::json!({"ttl_ms": 15000})),
                },
            ],
        }]
    }

    #[test]
    fn table_lines_up_and_names_everyone() {
        let t = to_table(&sample(), &[]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0].find("LEADER"), lines[1].find("node-a"));
        assert!(
            lines[1].contains("4.2s") && lines[1].contains("node-b (waiting, priority 10)"),
            "{t}"
        );
        // A priority of 0 (the default) is not shown.
        assert!(lines[1].contains("node-a (holding);"), "{t}");
    }

    #[test]
    fn control_characters_never_reach_the_terminal() {
        let mut roles = sample();
        roles[0].role = "r\u{1b}[2J\u{7f}\u{9b}\u{202e}".into();
        roles[0].holder = Some("\u{1b}]0;pwned\u{7}".into());
        roles[0].candidates[1].node = "b\\u{1b}\n".into();
        roles[0].squatters.push(Squatter {
            pid: 9,
            user: Some("m\u{1b}".into()),
            application_name: "\u{1b}[31m".into(),
            client_addr: None,
        });
        for text in [render(&roles, &[], false), render(&roles, &[], true)] {
            for bad in ['\u{1b}', '\u{7}', '\u{7f}', '\u{9b}', '\u{202e}'] {
                assert!(!text.contains(bad), "{bad:?} in {text}");
            }
        }
        let t = to_table(&roles, &[]);
        assert!(t.contains("r\\u{1b}[2J"), "{t}");
        // A literal backslash-u in the data cannot pass for an escape.
        assert!(t.contains("b\\\\u{1b}\\u{a}"), "{t}");
        assert!(t.contains("WARNING: role") && t.contains("pid 9"), "{t}");
        // JSON still parses back to the exact value.
        let v: serde_json::Value = serde_json::from_str(&render(&roles, &[], true)).unwrap();
        assert_eq!(v["roles"][0]["role"], "r\u{1b}[2J\u{7f}\u{9b}\u{202e}");
        assert_eq!(v["roles"][0]["squatters"][0]["backend_pid"], 9);
    }

    #[test]
    fn server_times_print_as_utc_with_milliseconds() {
        let at = |ms: u64| utc(UNIX_EPOCH + Duration::from_millis(ms));
        assert_eq!(at(1_795_640_400_123), "2026-11-25T21:00:00.123Z");
        assert_eq!(at(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            utc(UNIX_EPOCH - Duration::from_secs(1)),
            "1969-12-31T23:59:59.000Z"
        );
        // A leap day.
        assert_eq!(at(1_709_208_000_000), "2024-02-29T12:00:00.000Z");
    }

    #[test]
    fn json_is_stable() {
        let j = to_json(&sample(), &[]);
        assert_eq!(j["roles"][0]["term"], 7);
        assert_eq!(j["roles"][0]["lease_expired"], false);
        assert_eq!(j["roles"][0]["candidates"][1]["state"], "waiting");
    }
}
