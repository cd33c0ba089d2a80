//! A member's task: one loop that reads the group, applies the plan
//! ([`plan`](super::plan::plan)), and turns leaderships into events.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::future::poll_fn;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Notify};
use tokio::task::{JoinHandle, JoinSet};
use tokio_postgres::types::Type;
use tokio_postgres::{AsyncMessage, Client};
use tokio_util::sync::CancellationToken;

use crate::election::{Elector, Leadership, SharedLease, Term, LEADER_CHANNEL};
use crate::error::{Error, Result};
use crate::loss::{LossReason, LossSignal};

use super::plan::{plan, GroupView, PartitionView};
use super::{Carrier, Config, HeldPartition, PartitionEvent};

/// The group's view as one `json` value, computed from the tables, an
/// array of: every node it names, once (the rest refers to them by their
/// number in this list, from 0); the partitions (for each of the roles
/// `$1`, in order, `[holder while its lease runs, last term, the nodes
/// ready to take it]`); the live members; the live registrations that declare another
/// partition count than `$2` (`[node, declared, first registration in µs
/// since the epoch]`); and then each member's first registration (to tell
/// who came first), or null. Reads only; one
/// statement, through a pooler in transaction mode too. Live and ready,
/// from what only pgelect's candidates can write and what the server
/// sets:
///
/// * session backend: a registration whose backend lives, belongs to the
///   registering user and started before the registration; ready while it
///   still polls (`seen_at` refreshed);
/// * lease backend (no server session to check): a registration seen
///   within its own TTL (a standby's polls refresh it every half TTL;
///   ready), and a leader while its lease runs (a leader does not poll).
///
/// The roles are joined as a set (`unnest`), not matched with `= ANY`: the
/// planner estimates `= ANY` of a 1,000-element array element by element,
/// 15 ms of planning a read at 1,000 partitions, against 1.6 ms.
pub(super) fn view_sql(s: &str) -> String {
    format!(
        "WITH g AS MATERIALIZED (
             SELECT u.r, u.ord FROM unnest($1::text[]) WITH ORDINALITY AS u(r, ord)
         ), live AS MATERIALIZED (
             -- `n`: the partition count a member's registration declares
             -- (set by the group on its electors' meta), `since`: when it
             -- registered.
             SELECT c.role, c.node,
                    c.standby = 'polling'
                    AND c.seen_at >= now() - (greatest(2 * p.ms, 5000) + 2 * p.ms + 1000)
                                             * interval '1 millisecond' AS fresh,
                    c.meta->>'{PARTITIONS_KEY}' AS n, c.registered_at AS since
               FROM g
               JOIN {s}.candidates c ON c.role = g.r
               JOIN pg_catalog.pg_stat_activity a ON a.pid = c.backend_pid
               CROSS JOIN LATERAL (SELECT coalesce((c.timing->>'poll_interval_ms')::int8, 1000) AS ms) p
              WHERE c.backend = 'session'
                AND a.usename = c.db_user
                AND a.datid = (SELECT d.oid FROM pg_catalog.pg_database d
                                WHERE d.datname = pg_catalog.current_database())
                AND (a.backend_start IS NULL OR a.backend_start <= c.registered_at)
             UNION ALL
             SELECT c.role, c.node, true, c.meta->>'{PARTITIONS_KEY}', c.registered_at
               FROM g
               JOIN {s}.candidates c ON c.role = g.r
              WHERE c.backend = 'lease'
                AND c.seen_at + coalesce((c.timing->>'ttl_ms')::int8, 15000)
                                * interval '1 millisecond' >= now()
             UNION ALL
             -- A leader's count is on its row too: its registration is
             -- not refreshed while it leads, and would leave the view
             -- after a TTL. Its acquisition stands for its registration
             -- (which came before it).
             SELECT l.role, l.holder, false, l.holder_meta->>'{PARTITIONS_KEY}', l.acquired_at
               FROM g
               JOIN {s}.leaders l ON l.role = g.r
              WHERE l.backend = 'lease'
                AND l.holder IS NOT NULL AND l.lease_until > now()
         ), names AS MATERIALIZED (
             -- Every node the view names, each once, numbered from 0: the
             -- rest of the view refers to them by number.
             SELECT x.node, (row_number() OVER (ORDER BY x.node) - 1)::int4 AS i
               FROM (SELECT v.node FROM live v
                     UNION
                     SELECT l.holder
                       FROM g
                       JOIN {s}.leaders l ON l.role = g.r
                      WHERE l.holder IS NOT NULL AND l.lease_until > now()) x
         ), ready AS (
             SELECT v.role, pg_catalog.json_agg(nm.i) AS nodes
               FROM live v
               JOIN names nm ON nm.node = v.node
              WHERE v.fresh
              GROUP BY v.role
         ), declared AS (
             -- Registrations declaring another partition count than $2.
             SELECT v.node, v.n,
                    (extract(epoch FROM min(v.since)) * 1000000)::int8 AS since
               FROM live v
              WHERE v.n IS NOT NULL AND v.n <> $2::text
              GROUP BY v.node, v.n
         )
         -- [names, partitions, members, declared, since]: `json`, the
         -- text itself, which the server sends without converting it.
         SELECT pg_catalog.json_build_array(
                    (SELECT coalesce(pg_catalog.json_agg(nm.node ORDER BY nm.i), '[]'::json)
                       FROM names nm),
                    pg_catalog.json_agg(pg_catalog.json_build_array(
                        CASE WHEN l.lease_until > now() THEN h.i END,
                        l.term,
                        coalesce(r.nodes, '[]'::json)) ORDER BY u.ord),
                    (SELECT coalesce(pg_catalog.json_agg(nm.i), '[]'::json)
                       FROM names nm
                      WHERE EXISTS (SELECT 1 FROM live v WHERE v.node = nm.node)),
                    (SELECT coalesce(pg_catalog.json_agg(pg_catalog.json_build_array(d.node, d.n, d.since)),
                                     '[]'::json)
                       FROM declared d),
                    -- Each member's first registration, to tell who came
                    -- first: only while someone declares another count.
                    CASE WHEN EXISTS (SELECT 1 FROM declared) THEN
                         (SELECT pg_catalog.json_object_agg(f.node, f.since)
                            FROM (SELECT v.node, (extract(epoch FROM min(v.since)) * 1000000)::int8 AS since
                                    FROM live v WHERE v.since IS NOT NULL GROUP BY v.node) f)
                    END) AS view
           FROM g u
           LEFT JOIN {s}.leaders l ON l.role = u.r
           LEFT JOIN names h ON h.node = l.holder
           LEFT JOIN ready r ON r.role = u.r"
    )
}

/// A member's first statement of a read: the group's view as a member
/// kept it (`<schema>.group_views`, written only by candidates), and
/// whether this member is to compute it again ([`keep_sql`]) because it is
/// older than `$3` ms: the first member to find it so claims the refresh
/// for `$4` ms (longer than a computation takes; another member claims it
/// after that, or when the view is older than that), and the others take
/// the older view meanwhile, unless it is `$5` ms old (third column:
/// whether it is younger; older, the member skips this read). No row: no
/// view kept yet (the member computes one). So a fleet reading one group costs the server one
/// computation of its view per `$3` ms, not one per member and read: at
/// 1,000 members of 1,000 partitions, about 4 reads of 1,000 rows a
/// second instead of up to 1,000; the statement itself is a lookup of
/// one row, cheap to plan (the computation, 1.6 ms to plan at 1,000
/// partitions, is sent only by the member that refreshes). `$1` the
/// group, `$2` its partition count (members that declare another count
/// keep a view of their own).
pub(super) fn take_sql(s: &str) -> String {
    format!(
        "WITH claim AS (
             UPDATE {s}.group_views k
                SET claimed_until = now() + $4 * interval '1 millisecond'
              WHERE k.grp = $1 AND k.n = $2
                AND k.read_at <= now() - $3 * interval '1 millisecond'
                AND (k.claimed_until <= now()
                     OR k.read_at <= now() - $4 * interval '1 millisecond')
             RETURNING k.grp
         )
         SELECT k.view, EXISTS (SELECT 1 FROM claim),
                k.read_at > now() - $5 * interval '1 millisecond',
                (extract(epoch FROM k.read_at) * 1000000)::int8
           FROM {s}.group_views k
          WHERE k.grp = $1 AND k.n = $2"
    )
}

/// The refresh of a member's read ([`take_sql`]): the view computed now
/// ([`view_sql`]; `$1` the roles, `$2` their count), kept for the others
/// under the group `$3` unless a newer one is kept already.
pub(super) fn keep_sql(s: &str) -> String {
    let view = view_sql(s);
    format!(
        "WITH fresh AS MATERIALIZED (
             {view}
         ), kept AS (
             INSERT INTO {s}.group_views AS k (grp, n, read_at, claimed_until, view)
             SELECT $3, $2, now(), '-infinity', f.view FROM fresh f
             ON CONFLICT (grp, n) DO UPDATE
                SET view = EXCLUDED.view, read_at = EXCLUDED.read_at,
                    claimed_until = EXCLUDED.claimed_until
              WHERE k.read_at < EXCLUDED.read_at
         )
         SELECT f.view, (extract(epoch FROM now()) * 1000000)::int8 FROM fresh f"
    )
}

/// How old a kept view may be for a member to take it: a change in the
/// group reaches the members at most this much later than a read of
/// their own would show it.
pub(super) const VIEW_FRESH_FOR: Duration = Duration::from_millis(250);

/// How long a member's claim to refresh the kept view lasts (see
/// [`take_sql`]): after it, or once the view is this old, another member
/// claims it (the claimer may have died, frozen or timed out).
pub(super) const VIEW_CLAIM_FOR: Duration = Duration::from_secs(3);

/// How old a kept view may be for a member to act on it while another
/// member computes it again; older, the member skips that read. A view of
/// the group's first seconds, kept by its first member, says that member
/// is alone: taken by others seconds later, they would each count a share
/// of every partition.
pub(super) const VIEW_USABLE_FOR: Duration = Duration::from_secs(1);

/// The key of the electors' meta under which the group declares its
/// partition count, which the read compares between members.
pub(super) const PARTITIONS_KEY: &str = "pgelect_partitions";

/// What the group read shows: the view, each partition's last term, and
/// the live members that declare another partition count than `partitions`
/// and registered before `member` (who then refuses to take part).
pub(super) struct Read {
    pub(super) view: GroupView,
    pub(super) terms: Vec<Option<Term>>,
    pub(super) conflicts: Vec<String>,
    /// When the view was computed (µs since the epoch, the server's
    /// clock): members that read twice within a kept view's life get the
    /// same view, which shows no change since the first read.
    pub(super) at: Option<i64>,
}

/// Reads the group of `roles` as an observer (see [`view_sql`]): the
/// view computed now, nothing kept.
pub(super) async fn read(client: &Client, schema: &str, roles: &[String]) -> Result<Read> {
    let n = roles.len() as i64;
    let row = client
        .query_typed_one(
            &view_sql(schema),
            &[(&roles, Type::TEXT_ARRAY), (&n, Type::INT8)],
        )
        .await
        .map_err(|e| Error::db(READ, schema, e))?;
    decode(&row, None, roles.len(), schema)
}

/// A member's read of its group (see [`take_sql`]): on its own reading
/// connection, or between its lease client's statements
/// ([`SharedLease::read_group`]), each statement bounded by `bound`.
async fn read_as_member(
    via: Via<'_>,
    config: &Config,
    roles: &[String],
    bound: Duration,
) -> Result<Option<Read>> {
    let schema = config.options.schema_name().as_str();
    let n = roles.len() as i64;
    let fresh_ms = VIEW_FRESH_FOR.as_millis() as i64;
    let claim_ms = VIEW_CLAIM_FOR.as_millis() as i64;
    let usable_ms = VIEW_USABLE_FOR.as_millis() as i64;
    let rows = via
        .query(
            bound,
            &take_sql(schema),
            &[
                (&config.group, Type::TEXT),
                (&n, Type::INT8),
                (&fresh_ms, Type::INT8),
                (&claim_ms, Type::INT8),
                (&usable_ms, Type::INT8),
            ],
            schema,
        )
        .await?;
    if let Some(row) = rows.first() {
        let get = |e| Error::db(READ, schema, e);
        let claimed: bool = row.try_get(1).map_err(get)?;
        let recent: bool = row.try_get(2).map_err(get)?;
        match (claimed, recent) {
            (false, true) => {
                let at: i64 = row.try_get(3).map_err(get)?;
                let mut read = decode(row, Some(&config.member), roles.len(), schema)?;
                read.at = Some(at);
                return Ok(Some(read));
            }
            // Old, and another member is computing it: not acted on (a
            // view of the group's first seconds says its first member is
            // alone), nor computed again by every member at once.
            (false, false) => return Ok(None),
            (true, _) => {}
        }
    }
    let rows = via
        .query(
            bound,
            &keep_sql(schema),
            &[
                (&roles, Type::TEXT_ARRAY),
                (&n, Type::INT8),
                (&config.group, Type::TEXT),
            ],
            schema,
        )
        .await?;
    let row = rows.first().ok_or_else(|| Error::connection_lost(READ))?;
    let at: i64 = row.try_get(1).map_err(|e| Error::db(READ, schema, e))?;
    let mut read = decode(row, Some(&config.member), roles.len(), schema)?;
    read.at = Some(at);
    Ok(Some(read))
}

/// Where a member reads its group.
enum Via<'a> {
    Lease(&'a SharedLease),
    Reader(&'a Client),
}

impl Via<'_> {
    async fn query(
        &self,
        bound: Duration,
        sql: &str,
        params: &[(&(dyn tokio_postgres::types::ToSql + Sync), Type)],
        schema: &str,
    ) -> Result<Vec<tokio_postgres::Row>> {
        match self {
            Via::Lease(client) => client.read_group(bound, sql, params).await,
            Via::Reader(client) => {
                match tokio::time::timeout(bound, client.query_typed(sql, params)).await {
                    Ok(r) => r.map_err(|e| Error::db(READ, schema, e)),
                    Err(_) => Err(Error::connection_lost(READ)),
                }
            }
        }
    }
}

const READ: &str = "read the partition group";

/// A view as it is sent ([`view_sql`]): decoded into these types at once,
/// without a tree of values (at 1,000 members of 1,000 partitions, a
/// thousand views of 38 kB a second: the allocations of a generic tree were
/// most of the members' CPU).
type ViewParts = (
    Vec<String>,
    Vec<(Option<u32>, Option<i64>, Vec<u32>)>,
    Vec<u32>,
    Vec<(String, String, i64)>,
    Option<HashMap<String, i64>>,
);

/// The [`Read`] of a view ([`view_sql`], the row's first column) of
/// `partitions` partitions, for `member` (none for an observer).
fn decode(
    row: &tokio_postgres::Row,
    member: Option<&str>,
    partitions: usize,
    schema: &str,
) -> Result<Read> {
    let parts: tokio_postgres::types::Json<ViewParts> =
        row.try_get(0).map_err(|e| Error::db(READ, schema, e))?;
    decode_parts(parts.0, member, partitions, schema)
}

fn decode_parts(
    (names, ps, members, declared, since): ViewParts,
    member: Option<&str>,
    partitions: usize,
    schema: &str,
) -> Result<Read> {
    if ps.len() != partitions {
        // Only pgelect's own statement writes a view, so this is a view
        // written by something else: logged, and the read counts as
        // failed (the member backs off and reads again).
        tracing::warn!(%schema, partitions, found = ps.len(), "the group's view is not one this version of pgelect writes; is a row of {schema}.group_views written by something else?");
        return Err(Error::connection_lost(READ));
    }
    let known = |i: &u32| (*i as usize) < names.len();
    let in_range = ps
        .iter()
        .all(|(h, _, r)| h.as_ref().is_none_or(known) && r.iter().all(known))
        && members.iter().all(known);
    if !in_range {
        tracing::warn!(%schema, "the group's view names a node it does not list; is a row of {schema}.group_views written by something else?");
        return Err(Error::connection_lost(READ));
    }
    let mut view = GroupView {
        live: vec![false; names.len()],
        names,
        partitions: Vec::with_capacity(ps.len()),
    };
    let mut terms = Vec::with_capacity(ps.len());
    for (holder, term, ready) in ps {
        view.partitions.push(PartitionView { holder, ready });
        terms.push(term.map(Term::new));
    }
    for i in members {
        view.live[i as usize] = true;
    }
    let conflicts = match member {
        Some(me) => {
            let mine = since.as_ref().and_then(|s| s.get(me)).copied();
            let declared: Vec<(&str, &str, i64)> = declared
                .iter()
                .map(|(node, n, since)| (node.as_str(), n.as_str(), *since))
                .collect();
            conflicts(&declared, mine, me, partitions)
        }
        None => Vec::new(),
    };
    Ok(Read {
        view,
        terms,
        conflicts,
        at: None,
    })
}

/// The live members that declare another partition count than `partitions`
/// (a count of 1 to 9 digits) and registered before `me` first did
/// (`mine`; none: `me` has not registered yet), as "node declares n
/// partitions". Sorted, so that the refusal's text (which the driver
/// compares to send `Refused` once per conflict) does not change with the
/// order in which the server lists the same members.
fn conflicts(
    declared: &[(&str, &str, i64)],
    mine: Option<i64>,
    me: &str,
    partitions: usize,
) -> Vec<String> {
    let mine = mine.unwrap_or(i64::MAX);
    let mut out: Vec<String> = declared
        .iter()
        .filter(|&&(node, _, since)| node != me && since < mine)
        .filter_map(|&(node, n, _)| {
            let count = Some(n)
                .filter(|n| (1..=9).contains(&n.len()) && n.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|n| n.parse::<u64>().ok())?;
            (count != partitions as u64).then(|| format!("{node} declares {count} partitions"))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// A partition led by this member.
struct Lead {
    leadership: Leadership,
    /// Kept so that its role stays claimed on the shared connection until
    /// the release.
    elector: Elector,
    /// The [`HeldPartition`]'s loss signal: a child of the leadership's,
    /// ended by a handover too (with the planned reason).
    signal: LossSignal,
    /// Resolves when the application dropped its [`HeldPartition`].
    done: oneshot::Receiver<()>,
}

type Won = (u32, Result<Leadership>, Elector);

struct Driver {
    config: Arc<Config>,
    roles: Vec<String>,
    carrier: Carrier,
    events: mpsc::UnboundedSender<PartitionEvent>,
    held: Arc<Mutex<BTreeMap<u32, (Term, CancellationToken)>>>,
    /// The standbys' tasks, each with the token that stops it (it then
    /// withdraws its registration: a lease standby's row would otherwise
    /// look ready for a TTL).
    standing: HashMap<u32, (JoinHandle<()>, CancellationToken)>,
    leading: HashMap<u32, Lead>,
    won: mpsc::UnboundedSender<Won>,
    lost: mpsc::UnboundedSender<(u32, Term)>,
    releases: JoinSet<()>,
    /// The session backend's reading connection, which listens for the
    /// group's releases. On the lease backend the group is read on the
    /// member's lease client ([`SharedLease::read_group`]): one pooled
    /// client per member.
    reader: Option<Client>,
    wake: Arc<Notify>,
    /// The last error logged, to log a persistent one once.
    last_error: Option<String>,
    /// Why the member does not take part now (see [`Driver::refuse`]).
    refused: Option<String>,
    /// The other live members of the last read: while a read shows one
    /// more, members are joining and the plan starts no new standby. They
    /// are counted at the next read too: a member switching standbys has
    /// no registration for a moment, and a member missing from the count
    /// raises everyone's share (100 partitions over 99 members: 2).
    others: HashSet<String>,
    /// The share the last read computed (`None` before the first).
    share: Option<usize>,
    /// When the view of the last read was computed ([`Read::at`]).
    view_at: Option<i64>,
}

/// The member's task, until `stop` is cancelled (then it hands everything
/// over) or the group is dropped (then it is aborted).
pub(super) async fn run(
    config: Arc<Config>,
    events: mpsc::UnboundedSender<PartitionEvent>,
    held: Arc<Mutex<BTreeMap<u32, (Term, CancellationToken)>>>,
    stop: CancellationToken,
) {
    let (won, mut won_rx) = mpsc::unbounded_channel();
    let (lost, mut lost_rx) = mpsc::unbounded_channel();
    let carrier = match Carrier::new(&config) {
        Ok(c) => c,
        Err(e) => {
            // Checked by build() already.
            tracing::error!(group = %config.group, error = %e, "cannot start the partition member");
            return;
        }
    };
    let mut d = Driver {
        roles: config.roles(),
        carrier,
        config,
        events,
        held,
        standing: HashMap::new(),
        leading: HashMap::new(),
        won,
        lost,
        releases: JoinSet::new(),
        reader: None,
        wake: Arc::new(Notify::new()),
        last_error: None,
        refused: None,
        others: HashSet::new(),
        share: None,
        view_at: None,
    };
    tracing::info!(group = %d.config.group, member = %d.config.member, partitions = d.config.partitions, "joining partition group");
    let mut cadence = Cadence::new(d.config.rebalance_every);
    loop {
        // Whether this turn reads: a gain that leaves the member at or
        // over its share changes nothing it would do next (at 1,000
        // members of 1,000 partitions, a read per gain was 1,000 reads of
        // 1,000 rows within a cold start's first seconds).
        let mut read_now = true;
        tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            Some((p, r, e)) = won_rx.recv() => {
                d.on_won(p, r, e);
                read_now = d.under_share();
            }
            Some((p, term)) = lost_rx.recv() => d.on_lost(p, term),
            _ = d.wake.notified() => {}
            _ = tokio::time::sleep_until(cadence.next) => {}
        }
        // Gains and losses that arrived together are applied before one
        // read.
        while let Ok((p, r, e)) = won_rx.try_recv() {
            d.on_won(p, r, e);
            read_now |= d.under_share();
        }
        while let Ok((p, term)) = lost_rx.try_recv() {
            d.on_lost(p, term);
            read_now = true;
        }
        if !read_now && tokio::time::Instant::now() < cadence.next {
            continue;
        }
        let pace = d.rebalance().await;
        cadence.after(pace);
    }
    // Leaving: no more standbys, every partition handed over cleanly.
    for (_, (t, stop)) in d.standing.drain() {
        stop.cancel();
        d.releases.spawn(async move {
            let _ = t.await;
        });
    }
    while let Ok((_, r, _e)) = won_rx.try_recv() {
        if let Ok(l) = r {
            // Granted but never announced: nobody acts on it.
            let _ = l.resign().await;
        }
    }
    let ps: Vec<u32> = d.leading.keys().copied().collect();
    for p in ps {
        d.hand_over(p, LossReason::Shutdown);
    }
    while d.releases.join_next().await.is_some() {}
    tracing::info!(group = %d.config.group, member = %d.config.member, "left partition group");
}

/// When the member reads the group next ([`Cadence::after`]):
///
/// * every `rebalance_every` while the member has work that the next
///   reads decide ([`Pace::Busy`]): it is over its share, or could stand
///   for a partition it does not stand for yet, or this read started,
///   stopped or handed over something, or showed a member missing (the
///   next read confirms the smaller count);
/// * otherwise ([`Pace::Quiet`]: balanced, or changes that give it
///   nothing to do) twice as long after each read, up to a cap of
///   [`QUIET_READS_AT_MOST`] times `rebalance_every`, or more in a big
///   group: as many times as the fleet's quiet reads of `members` x
///   `partitions` rows need to stay within [`FLEET_READ_ROWS`] a second
///   per second of `rebalance_every` (10 s at 1,000 members of 1,000
///   partitions);
/// * after a failed read ([`Pace::Failed`]) twice as long each time, up to
///   twice that cap, so that a fleet whose pooler or server is overloaded
///   backs off instead of retrying together every second.
///
/// Each interval is shortened by up to a quarter at random, so that the
/// members' reads spread out. Every member reading its group every
/// second was most of the server's work at 300 members, and at 1,000
/// members of 1,000 partitions more than two cores' worth.
struct Cadence {
    base: Duration,
    every: Duration,
    /// The quiet cap of the last successful read's group.
    cap: Duration,
    next: tokio::time::Instant,
}

/// How the last read went, for the next one ([`Cadence`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pace {
    Busy {
        members: usize,
        partitions: usize,
    },
    /// The read showed the same kept view as the one before (or none:
    /// another member was computing it), and the member has work: it reads
    /// again as soon as the view can be a newer one.
    Soon,
    Quiet {
        members: usize,
        partitions: usize,
    },
    Failed,
}

/// How many times `rebalance_every` a quiet member of a small group waits
/// at most between two reads: what a dead member's partitions may wait,
/// after their leases ran out, for a member to notice them (at most 4 s
/// by default).
const QUIET_READS_AT_MOST: u32 = 4;

/// The rows (partitions) that a fleet's quiet reads may read per
/// `rebalance_every` at most (see [`Cadence`]): 100,000, a hundred reads
/// of 1,000 partitions. Up to 400 members of 1,000 partitions, or 630 of
/// 630, the cap stays at [`QUIET_READS_AT_MOST`]; in bigger groups it
/// grows with members x partitions, and since the fleet's reads are
/// spread out, some member still reads every `rebalance_every` / 100 or
/// so: a dead member's unled partitions are noticed as soon as in a small
/// group.
const FLEET_READ_ROWS: u64 = 100_000;

impl Cadence {
    fn new(base: Duration) -> Cadence {
        Cadence {
            base,
            every: base,
            cap: base * QUIET_READS_AT_MOST,
            // The first read at once.
            next: tokio::time::Instant::now(),
        }
    }

    /// The longest interval between two quiet reads of a member of
    /// `members` members and `partitions` partitions.
    fn quiet_cap(&self, members: usize, partitions: usize) -> Duration {
        let rows = members as u64 * partitions as u64;
        let times = rows
            .div_ceil(FLEET_READ_ROWS)
            .max(u64::from(QUIET_READS_AT_MOST));
        self.base * u32::try_from(times).unwrap_or(u32::MAX)
    }

    fn after(&mut self, pace: Pace) {
        if pace == Pace::Soon {
            // Once the kept view can have been computed again; the pace
            // itself does not change.
            let cut = VIEW_FRESH_FOR
                .mul_f64((crate::election::config::random_u64() % 1_000) as f64 / 4_000.0);
            self.next = tokio::time::Instant::now() + VIEW_FRESH_FOR * 2 - cut;
            return;
        }
        self.every = match pace {
            Pace::Soon => unreachable!("BUG: handled above"),
            Pace::Busy {
                members,
                partitions,
            } => {
                self.cap = self.quiet_cap(members, partitions);
                self.base
            }
            Pace::Quiet {
                members,
                partitions,
            } => {
                self.cap = self.quiet_cap(members, partitions);
                (self.every * 2).min(self.cap)
            }
            Pace::Failed => (self.every * 2).min(self.cap * 2),
        };
        let cut = self
            .every
            .mul_f64((crate::election::config::random_u64() % 1_000) as f64 / 4_000.0);
        self.next = tokio::time::Instant::now() + (self.every - cut);
    }
}

impl Driver {
    fn on_won(&mut self, p: u32, r: Result<Leadership>, elector: Elector) {
        if let Some(t) = self.standing.remove(&p) {
            // The task ended by sending; this only reaps it.
            drop(t);
        }
        let leadership = match r {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(group = %self.config.group, partition = p, error = %e, "standing for a partition failed; retrying at the next rebalancing");
                return;
            }
        };
        let term = leadership.term();
        let (context, signal) = leadership.with_child_signal();
        let (done_tx, done) = oneshot::channel();
        let watch = signal.raw_token().clone();
        let lost = self.lost.clone();
        // `PartitionGroup::held` leaves the partition out the moment this
        // token is cancelled, not when this loop next turns (it may be
        // waiting for a read).
        let ended = watch.clone();
        tokio::spawn(async move {
            watch.cancelled().await;
            let _ = lost.send((p, term));
        });
        let held = HeldPartition {
            partition: p,
            context,
            _done: done_tx,
        };
        self.leading.insert(
            p,
            Lead {
                leadership,
                elector,
                signal,
                done,
            },
        );
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(p, (term, ended));
        tracing::info!(group = %self.config.group, member = %self.config.member, partition = p, %term, "partition gained");
        let _ = self.events.send(PartitionEvent::Gained(held));
    }

    /// A leadership's token was cancelled: by the elector (a loss), or by a
    /// handover (then it is gone from `leading` already).
    fn on_lost(&mut self, p: u32, term: Term) {
        if self
            .leading
            .get(&p)
            .is_some_and(|l| l.leadership.term() == term)
        {
            let reason = self.leading[&p]
                .leadership
                .loss()
                .map_or(LossReason::Resigned, |l| l.reason());
            self.hand_over(p, reason);
        }
    }

    /// Ends `p`'s leadership with `reason`: cancels the application's token,
    /// announces the loss, and releases once the application dropped its
    /// handle (at most `release_grace`).
    fn hand_over(&mut self, p: u32, reason: LossReason) {
        let Some(lead) = self.leading.remove(&p) else {
            return;
        };
        // A leadership already lost keeps its own (earlier) loss.
        lead.signal.end(reason);
        let term = lead.leadership.term();
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&p);
        tracing::info!(group = %self.config.group, member = %self.config.member, partition = p, %term, %reason, "partition lost");
        let _ = self.events.send(PartitionEvent::Lost {
            partition: p,
            term,
            reason,
        });
        let grace = self.config.release_grace;
        let group = self.config.group.clone();
        self.releases.spawn(async move {
            if tokio::time::timeout(grace, lead.done).await.is_err() {
                tracing::warn!(%group, partition = p, ?grace, "the application still held the partition after the release grace; releasing anyway");
            }
            if let Err(e) = lead.leadership.resign().await {
                tracing::warn!(%group, partition = p, error = %e, "releasing a partition failed");
            }
            // No longer standing for it: a lease candidate's registration
            // would count this member as ready for it, and (after `leave`)
            // as live, for up to a TTL.
            if let Err(e) = lead.elector.withdraw().await {
                tracing::debug!(%group, partition = p, error = %e, "could not withdraw the partition's registration; it is left stale");
            }
            drop(lead.elector);
        });
    }

    /// Reads the group and applies the plan; errors are logged (once while
    /// they persist) and retried later. Returns how the next read should
    /// be paced (see [`Cadence`]).
    async fn rebalance(&mut self) -> Pace {
        // Reap finished releases.
        while self.releases.try_join_next().is_some() {}
        let read = match self.read().await {
            Ok(Some(v)) => {
                self.last_error = None;
                v
            }
            Ok(None) => {
                // Another member is computing the group's view: this turn
                // does nothing, and the next reads again soon.
                self.last_error = None;
                return Pace::Soon;
            }
            Err(e) => {
                let text = e.to_string();
                if self.last_error.as_ref() != Some(&text) {
                    tracing::warn!(group = %self.config.group, member = %self.config.member, error = %text, "reading the partition group failed; retrying");
                    self.last_error = Some(text);
                }
                self.reader = None;
                return Pace::Failed;
            }
        };
        let partitions = self.roles.len();
        if !read.conflicts.is_empty() {
            self.refuse(&read.conflicts);
            // Reads on at the base pace, to take part again soon.
            return Pace::Busy {
                members: self.others.len() + 1,
                partitions,
            };
        }
        if self.refused.take().is_some() {
            tracing::info!(group = %self.config.group, member = %self.config.member, partitions = self.config.partitions, "no earlier member declares another partition count any more; taking part again");
        }
        let mut view = read.view;
        let held: BTreeSet<u32> = self.leading.keys().copied().collect();
        let standing: BTreeSet<u32> = self.standing.keys().copied().collect();
        let me = self.config.member.as_str();
        // (Sets of up to thousands of names, read every second or so: not
        // copied.)
        // The same kept view as the last read's is no second look: it
        // cannot show that members stopped joining.
        let again = read.at.is_some() && read.at == self.view_at;
        self.view_at = read.at;
        let settled = !again && view.members().all(|m| m == me || self.others.contains(m));
        // A member missing: it is still counted this once (see `others`);
        // the next read, soon, confirms the smaller count.
        let absent: HashSet<String> = {
            let live: HashSet<&str> = view.members().collect();
            std::mem::take(&mut self.others)
                .into_iter()
                .filter(|o| !live.contains(o.as_str()))
                .collect()
        };
        let missing = !absent.is_empty();
        for a in &absent {
            view.add_member(a.clone());
        }
        let plan = plan(me, &view, &held, &standing, settled);
        // This read's live members but me, the absent ones not again.
        self.others = view
            .names
            .into_iter()
            .zip(view.live)
            .filter(|(n, l)| *l && n != me && !absent.contains(n))
            .map(|(n, _)| n)
            .collect();
        self.share = Some(plan.share);
        // A member over its share waits for standbys to hand over to: it
        // keeps looking at `rebalance_every` (`plan.busy`).
        let changes = !plan.stand.is_empty() || !plan.unstand.is_empty() || !plan.resign.is_empty();
        let pace = if again && plan.busy {
            Pace::Soon
        } else if plan.busy || changes || missing {
            Pace::Busy {
                members: plan.members,
                partitions,
            }
        } else {
            Pace::Quiet {
                members: plan.members,
                partitions,
            }
        };
        if changes || !settled || missing {
            tracing::debug!(group = %self.config.group, member = %self.config.member, members = plan.members, share = plan.share, held = held.len(), stand = ?plan.stand, unstand = ?plan.unstand, resign = ?plan.resign, ?pace, "rebalancing");
        }
        for p in plan.unstand {
            if let Some((_, stop)) = self.standing.remove(&p) {
                stop.cancel();
            }
        }
        for p in plan.resign {
            self.hand_over(p, LossReason::HandedOver);
        }
        // New standbys at most as many as the partitions held (one when
        // none): a member that counts few members takes its share in
        // rounds that double, each as soon as it gains, so that a member
        // that found itself alone while the others of a fleet started
        // together were still logging in does not win most partitions
        // and hand them over one by one.
        let room = held.len().max(1).saturating_sub(self.standing.len());
        for p in plan.stand.into_iter().take(room) {
            self.stand(p);
        }
        pace
    }

    /// Whether the member leads fewer partitions than its share as its
    /// last read counted it (true before its first read).
    fn under_share(&self) -> bool {
        self.share.is_none_or(|s| self.leading.len() < s)
    }

    /// Members that registered earlier declare another partition count:
    /// stops standing, hands every partition over, and says so (once
    /// while the conflict lasts: an error in the log and a
    /// [`PartitionEvent::Refused`]). It reads on, and takes part again when
    /// no such member is left.
    fn refuse(&mut self, conflicts: &[String]) {
        for (_, (_, stop)) in self.standing.drain() {
            stop.cancel();
        }
        let held: Vec<u32> = self.leading.keys().copied().collect();
        for p in held {
            self.hand_over(p, LossReason::HandedOver);
        }
        let reason = format!(
            "member {:?} declares {} partitions for group {:?}, but members that joined earlier do not: {}; every member of a group must use the same number of partitions",
            self.config.member,
            self.config.partitions,
            self.config.group,
            conflicts.join(", ")
        );
        if self.refused.as_ref() != Some(&reason) {
            tracing::error!(group = %self.config.group, member = %self.config.member, "{reason}; not taking part while they run");
            let _ = self.events.send(PartitionEvent::Refused {
                reason: reason.clone(),
            });
            self.refused = Some(reason);
        }
    }

    fn stand(&mut self, p: u32) {
        let elector = match self.config.elector_builder(p, &self.carrier).build() {
            Ok(e) => e,
            Err(e) => {
                // The elector of a standby just stopped may not be dropped
                // yet (its role is still claimed): the next tick retries.
                tracing::debug!(group = %self.config.group, partition = p, error = %e, "cannot stand for the partition yet");
                return;
            }
        };
        let won = self.won.clone();
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            let r = tokio::select! {
                r = elector.leadership() => Some(r),
                _ = stopped.cancelled() => None,
            };
            match r {
                Some(r) => {
                    let _ = won.send((p, r, elector));
                }
                None => {
                    if let Err(e) = elector.withdraw().await {
                        tracing::debug!(partition = p, error = %e, "could not withdraw a standby's registration; it is left stale");
                    }
                }
            }
        });
        self.standing.insert(p, (task, stop));
    }

    async fn read(&mut self) -> Result<Option<Read>> {
        if let Carrier::Lease(client) = &self.carrier {
            // The lease client's own bound for a standby's statement: the
            // read waits behind a renewal at most, and a renewal behind it.
            return read_as_member(
                Via::Lease(client),
                &self.config,
                &self.roles,
                LEASE_READ_BOUND,
            )
            .await;
        }
        if self.reader.as_ref().is_none_or(|c| c.is_closed()) {
            self.reader = Some(self.open_reader().await?);
        }
        let client = self.reader.as_ref().expect("BUG: opened above");
        let bound = Duration::from_secs(5).max(self.config.rebalance_every);
        read_as_member(Via::Reader(client), &self.config, &self.roles, bound).await
    }

    /// The reading connection, listening for releases of the group's roles
    /// (which wake the loop at once).
    async fn open_reader(&self) -> Result<Client> {
        let app = format!("pgelect:partitions:{}", self.config.group);
        let (client, mut conn) = self.config.options.connect_plain(&app).await?;
        let schema = self.config.options.schema_name().as_str().to_owned();
        let prefix = format!("{schema}:released:{}/", self.config.group);
        let wake = self.wake.clone();
        tokio::spawn(async move {
            while let Some(m) = poll_fn(|cx| conn.poll_message(cx)).await {
                match m {
                    Ok(AsyncMessage::Notification(n)) if n.payload().starts_with(&prefix) => {
                        wake.notify_one();
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
        });
        client
            .batch_execute(&format!("LISTEN {LEADER_CHANNEL}"))
            .await
            .map_err(|e| Error::db("listen for releases of the partition group", &schema, e))?;
        Ok(client)
    }
}

/// How long a member's read of its group on the lease client may take:
/// as the client's acquires and registrations (renewals may wait behind
/// it).
const LEASE_READ_BOUND: Duration = Duration::from_secs(2);

#[cfg(test)]
mod tests {
    use super::*;

    /// The intervals (whole seconds) after each pace, each checked to be
    /// shortened by at most a quarter.
    fn intervals(c: &mut Cadence, paces: &[Pace]) -> Vec<u64> {
        let mut seen = Vec::new();
        for &pace in paces {
            let before = tokio::time::Instant::now();
            c.after(pace);
            // Shortened by at most a quarter, never lengthened (beyond the
            // time this test takes between its clock and the cadence's).
            let wait = c.next - before;
            assert!(
                wait <= c.every + Duration::from_millis(100) && wait >= c.every * 3 / 4,
                "{wait:?} of {:?}",
                c.every
            );
            seen.push(c.every.as_secs());
        }
        seen
    }

    #[test]
    fn quiet_reads_slow_down_to_four_intervals_and_any_work_restores_the_pace() {
        let mut c = Cadence::new(Duration::from_secs(1));
        let (members, partitions) = (3, 12);
        let quiet = Pace::Quiet {
            members,
            partitions,
        };
        let busy = Pace::Busy {
            members,
            partitions,
        };
        assert_eq!(
            intervals(&mut c, &[quiet, quiet, quiet, quiet, busy, quiet]),
            [2, 4, 4, 4, 1, 2]
        );
    }

    #[test]
    fn in_a_big_group_quiet_reads_slow_down_with_the_fleet_and_failures_back_off() {
        let mut c = Cadence::new(Duration::from_secs(1));
        // 630 x 630 rows: still the small group's cap.
        let small = Pace::Quiet {
            members: 630,
            partitions: 630,
        };
        assert_eq!(intervals(&mut c, &[small, small, small]), [2, 4, 4]);
        // 1,000 x 1,000: the fleet's quiet reads stay at 100,000 rows a
        // second, each member reading every 10 s.
        let big = Pace::Quiet {
            members: 1000,
            partitions: 1000,
        };
        assert_eq!(intervals(&mut c, &[big, big, big]), [8, 10, 10]);
        // Failed reads back off to twice the last cap, and a busy read
        // restores the base pace.
        let f = Pace::Failed;
        let busy = Pace::Busy {
            members: 1000,
            partitions: 1000,
        };
        assert_eq!(
            intervals(&mut c, &[f, f, busy, f, f, f, f, f]),
            [20, 20, 1, 2, 4, 8, 16, 20]
        );
    }

    #[test]
    fn the_read_only_reads() {
        let sql = view_sql("pgelect").to_lowercase();
        for w in [
            "insert",
            "update",
            "delete",
            "pg_notify",
            "for share",
            "for update",
        ] {
            assert!(!sql.contains(w), "{w} in {sql}");
        }
        assert!(sql.contains("a.usename = c.db_user"));
        assert!(sql.contains("a.backend_start <= c.registered_at"));
    }

    #[test]
    fn a_members_read_writes_only_the_kept_view() {
        for sql in [take_sql("pgelect"), keep_sql("pgelect")] {
            let sql = sql.to_lowercase();
            for w in ["delete", "pg_notify", "for share", "for update"] {
                assert!(!sql.contains(w), "{w} in {sql}");
            }
            for table in ["leaders", "candidates", "migrations"] {
                for verb in ["update", "insert into"] {
                    let write = format!("{verb} pgelect.{table}");
                    assert!(!sql.contains(&write), "{write} in {sql}");
                }
            }
            assert!(sql.contains("pgelect.group_views"));
        }
    }

    fn view(declared: serde_json::Value, since: serde_json::Value) -> ViewParts {
        serde_json::from_value(serde_json::json!([
            ["a", "b", "c"],
            [[0, 3, [1]], [null, null, []]],
            [0, 1, 2],
            declared,
            since,
        ]))
        .unwrap()
    }

    #[test]
    fn a_view_decodes_into_the_plans_snapshot() {
        let none = || view(serde_json::json!([]), serde_json::Value::Null);
        let r = decode_parts(none(), Some("b"), 2, "pgelect").unwrap();
        let holder = r.view.partitions[0].holder.map(|h| r.view.name(h));
        assert_eq!(holder, Some("a"));
        let ready: Vec<&str> = r.view.partitions[0]
            .ready
            .iter()
            .map(|&i| r.view.name(i))
            .collect();
        assert_eq!(ready, ["b"]);
        assert_eq!(r.view.partitions[1], PartitionView::default());
        assert_eq!(r.terms, [Some(Term::new(3)), None]);
        assert_eq!(r.view.members().count(), 3);
        assert!(r.conflicts.is_empty());
        // A view of another partition count than the reader's: refused.
        assert!(decode_parts(none(), Some("b"), 3, "pgelect").is_err());
        // A view naming a node it does not list: refused.
        let mut bad = none();
        bad.1[1].0 = Some(7);
        assert!(decode_parts(bad, Some("b"), 2, "pgelect").is_err());
    }

    #[test]
    fn only_earlier_members_declaring_another_count_are_conflicts() {
        let v = || {
            view(
                serde_json::json!([["a", "8", 10], ["c", "8", 30], ["d", "x", 5], ["e", "2", 5]]),
                serde_json::json!({"a": 10, "b": 20, "c": 30}),
            )
        };
        // b registered at 20: a (10) came first, c (30) after; d's count
        // is no count; e declares 2, the reader's own.
        let r = decode_parts(v(), Some("b"), 2, "pgelect").unwrap();
        assert_eq!(r.conflicts, ["a declares 8 partitions"]);
        // Not registered yet: every such member came first.
        let r = decode_parts(v(), Some("z"), 2, "pgelect").unwrap();
        assert_eq!(
            r.conflicts,
            ["a declares 8 partitions", "c declares 8 partitions"]
        );
        // An observer has none.
        assert!(decode_parts(v(), None, 2, "pgelect")
            .unwrap()
            .conflicts
            .is_empty());
    }
}
