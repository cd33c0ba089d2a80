//! A member's task: one loop that reads the group, applies the plan
//! ([`plan`](super::plan::plan)), and turns leaderships into events.

use std::collections::{BTreeMap, BTreeSet, HashMap};
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

/// The rebalancing read: for each of the roles `$1` (in order), the
/// holder while its lease runs, the last term, and the nodes ready to take
/// it; and the group's live members. Reads only; one statement, through a
/// pooler in transaction mode too. Live and ready, from what only
/// pgelect's candidates can write and what the server sets:
///
/// * session backend: a registration whose backend lives, belongs to the
///   registering user and started before the registration; ready while it
///   still polls (`seen_at` refreshed);
/// * lease backend (no server session to check): a registration seen
///   within its own TTL (a standby's polls refresh it every half TTL;
///   ready), and a leader while its lease runs (a leader does not poll).
pub(super) fn read_sql(s: &str) -> String {
    // `n`: the partition count a member's registration declares (set by
    // the group on its electors' meta), `since`: when it registered.
    let declared = format!(
        "CASE WHEN c.meta->>'{PARTITIONS_KEY}' ~ '^[0-9]{{1,9}}$'
              THEN (c.meta->>'{PARTITIONS_KEY}')::int8 END"
    );
    format!(
        "WITH live AS MATERIALIZED (
             SELECT c.role, c.node,
                    c.standby = 'polling'
                    AND c.seen_at >= now() - (greatest(2 * p.ms, 5000) + 2 * p.ms + 1000)
                                             * interval '1 millisecond' AS fresh,
                    {declared} AS n, c.registered_at AS since
               FROM {s}.candidates c
               JOIN pg_catalog.pg_stat_activity a ON a.pid = c.backend_pid
               CROSS JOIN LATERAL (SELECT coalesce((c.timing->>'poll_interval_ms')::int8, 1000) AS ms) p
              WHERE c.role = ANY($1::text[]) AND c.backend = 'session'
                AND a.usename = c.db_user
                AND a.datid = (SELECT d.oid FROM pg_catalog.pg_database d
                                WHERE d.datname = pg_catalog.current_database())
                AND (a.backend_start IS NULL OR a.backend_start <= c.registered_at)
             UNION ALL
             SELECT c.role, c.node, true, {declared}, c.registered_at
               FROM {s}.candidates c
              WHERE c.role = ANY($1::text[]) AND c.backend = 'lease'
                AND c.seen_at + coalesce((c.timing->>'ttl_ms')::int8, 15000)
                                * interval '1 millisecond' >= now()
             UNION ALL
             SELECT l.role, l.holder, false, NULL::int8, NULL::timestamptz
               FROM {s}.leaders l
              WHERE l.role = ANY($1::text[]) AND l.backend = 'lease'
                AND l.holder IS NOT NULL AND l.lease_until > now()
         ), other AS (
             -- Live members declaring another partition count than $3,
             -- registered before member $2 first did (or $2 has none yet).
             SELECT v.node, v.n, min(v.since) AS since
               FROM live v
              WHERE v.n IS NOT NULL AND v.n <> $3 AND v.node IS DISTINCT FROM $2
              GROUP BY v.node, v.n
         ), ready AS (
             SELECT v.role, array_agg(v.node) AS nodes
               FROM live v
              WHERE v.fresh
              GROUP BY v.role
         )
         -- The members and the conflicts are the group's, not a
         -- partition's: sent on the first row only.
         SELECT CASE WHEN l.lease_until > now() THEN l.holder END,
                l.term,
                coalesce(r.nodes, '{{}}'::text[]),
                CASE WHEN u.ord = 1 THEN
                     (SELECT coalesce(array_agg(DISTINCT v.node), '{{}}'::text[]) FROM live v)
                ELSE '{{}}'::text[] END,
                CASE WHEN u.ord = 1 THEN
                     (SELECT coalesce(array_agg(o.node || ' declares ' || o.n || ' partitions'
                                                ORDER BY o.since), '{{}}'::text[])
                        FROM other o
                       WHERE o.since < coalesce((SELECT min(v.since) FROM live v WHERE v.node = $2),
                                                'infinity'))
                ELSE '{{}}'::text[] END
           FROM unnest($1::text[]) WITH ORDINALITY AS u(r, ord)
           LEFT JOIN {s}.leaders l ON l.role = u.r
           LEFT JOIN ready r ON r.role = u.r
          ORDER BY u.ord"
    )
}

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
}

/// Reads the group (see [`read_sql`]) of `roles`, as member `member` (none
/// for an observer) declaring `roles.len()` partitions.
pub(super) async fn read(
    client: &Client,
    schema: &str,
    roles: &[String],
    member: Option<&str>,
) -> Result<Read> {
    let n = roles.len() as i64;
    let rows = client
        .query_typed(
            &read_sql(schema),
            &[
                (&roles, Type::TEXT_ARRAY),
                (&member, Type::TEXT),
                (&n, Type::INT8),
            ],
        )
        .await
        .map_err(|e| Error::db(READ, schema, e))?;
    decode(rows, schema)
}

/// [`read`] on a member's lease client, between the client's own
/// statements (see [`SharedLease::read_group`]), bounded by `bound`.
async fn read_on_lease(
    client: &SharedLease,
    schema: &str,
    roles: &[String],
    member: &str,
    bound: Duration,
) -> Result<Read> {
    let n = roles.len() as i64;
    let member = Some(member);
    let rows = client
        .read_group(
            bound,
            &read_sql(schema),
            &[
                (&roles, Type::TEXT_ARRAY),
                (&member, Type::TEXT),
                (&n, Type::INT8),
            ],
        )
        .await?;
    decode(rows, schema)
}

const READ: &str = "read the partition group";

fn decode(rows: Vec<tokio_postgres::Row>, schema: &str) -> Result<Read> {
    let mut view = GroupView::default();
    let mut terms = Vec::with_capacity(rows.len());
    let mut conflicts = Vec::new();
    for row in rows {
        let get = |e| Error::db(READ, schema, e);
        let holder: Option<String> = row.try_get(0).map_err(get)?;
        let term: Option<i64> = row.try_get(1).map_err(get)?;
        let ready: Vec<String> = row.try_get(2).map_err(get)?;
        let members: Vec<String> = row.try_get(3).map_err(get)?;
        let declared: Vec<String> = row.try_get(4).map_err(get)?;
        conflicts.extend(declared);
        view.members.extend(members);
        view.partitions.push(PartitionView { holder, ready });
        terms.push(term.map(Term::new));
    }
    // Sorted, so that the refusal's text (which the driver compares to
    // send `Refused` once per conflict) does not change with the order
    // in which the server lists the same members.
    conflicts.sort();
    conflicts.dedup();
    Ok(Read {
        view,
        terms,
        conflicts,
    })
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
    others: BTreeSet<String>,
    /// The share the last read computed (`None` before the first).
    share: Option<usize>,
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
        others: BTreeSet::new(),
        share: None,
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
    Busy { members: usize, partitions: usize },
    Quiet { members: usize, partitions: usize },
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
        self.every = match pace {
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
            Ok(v) => {
                self.last_error = None;
                v
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
        let mut others = view.members.clone();
        others.remove(&self.config.member);
        let settled = others.is_subset(&self.others);
        // A member missing: it is still counted this once (see `others`);
        // the next read, soon, confirms the smaller count.
        let missing = !self.others.is_subset(&others);
        view.members
            .extend(std::mem::replace(&mut self.others, others));
        let plan = plan(&self.config.member, &view, &held, &standing, settled);
        self.share = Some(plan.share);
        // A member over its share waits for standbys to hand over to: it
        // keeps looking at `rebalance_every` (`plan.busy`).
        let changes = !plan.stand.is_empty() || !plan.unstand.is_empty() || !plan.resign.is_empty();
        let pace = if plan.busy || changes || missing {
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
        for p in plan.stand {
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

    async fn read(&mut self) -> Result<Read> {
        let schema = self.config.options.schema_name().as_str();
        let member = &self.config.member;
        if let Carrier::Lease(client) = &self.carrier {
            // The lease client's own bound for a standby's statement: the
            // read waits behind a renewal at most, and a renewal behind it.
            return read_on_lease(client, schema, &self.roles, member, LEASE_READ_BOUND).await;
        }
        if self.reader.as_ref().is_none_or(|c| c.is_closed()) {
            self.reader = Some(self.open_reader().await?);
        }
        let client = self.reader.as_ref().expect("BUG: opened above");
        let bound = Duration::from_secs(5).max(self.config.rebalance_every);
        match tokio::time::timeout(bound, read(client, schema, &self.roles, Some(member))).await {
            Ok(r) => r,
            Err(_) => Err(Error::connection_lost(READ)),
        }
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
        let sql = read_sql("pgelect").to_lowercase();
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
}
