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

use crate::election::{Backend, Elector, Leadership, Term, LEADER_CHANNEL};
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
    const WHAT: &str = "read the partition group";
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
        .map_err(|e| Error::db(WHAT, schema, e))?;
    let mut view = GroupView::default();
    let mut terms = Vec::with_capacity(rows.len());
    let mut conflicts = Vec::new();
    for row in rows {
        let get = |e| Error::db(WHAT, schema, e);
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
    held: Arc<Mutex<BTreeMap<u32, Term>>>,
    /// The standbys' tasks, each with the token that stops it (it then
    /// withdraws its registration: a lease standby's row would otherwise
    /// look ready for a TTL).
    standing: HashMap<u32, (JoinHandle<()>, CancellationToken)>,
    leading: HashMap<u32, Lead>,
    won: mpsc::UnboundedSender<Won>,
    lost: mpsc::UnboundedSender<(u32, Term)>,
    releases: JoinSet<()>,
    /// The reading connection: the session backend's listens for the
    /// group's releases; the lease backend's goes where the lease client
    /// goes (a pooler too) and does not listen.
    reader: Option<Reader>,
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
}

/// The member's task, until `stop` is cancelled (then it hands everything
/// over) or the group is dropped (then it is aborted).
pub(super) async fn run(
    config: Arc<Config>,
    events: mpsc::UnboundedSender<PartitionEvent>,
    held: Arc<Mutex<BTreeMap<u32, Term>>>,
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
    };
    tracing::info!(group = %d.config.group, member = %d.config.member, partitions = d.config.partitions, "joining partition group");
    let mut cadence = Cadence::new(d.config.rebalance_every);
    loop {
        let mut eventful = true;
        tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            Some((p, r, e)) = won_rx.recv() => d.on_won(p, r, e),
            Some((p, term)) = lost_rx.recv() => d.on_lost(p, term),
            _ = d.wake.notified() => {}
            _ = tokio::time::sleep_until(cadence.next) => eventful = false,
        }
        // Gains and losses that arrived together are applied before one
        // read.
        while let Ok((p, r, e)) = won_rx.try_recv() {
            d.on_won(p, r, e);
            eventful = true;
        }
        while let Ok((p, term)) = lost_rx.try_recv() {
            d.on_lost(p, term);
            eventful = true;
        }
        let quiet = d.rebalance().await;
        cadence.after(quiet && !eventful);
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

/// When the member reads the group next: every `rebalance_every` while
/// anything changes; after each read that changed nothing (no gain, loss,
/// wake, new or missing member, nor anything to start, stop or hand over,
/// and the member not over its share) twice as long, up to
/// [`QUIET_READS_AT_MOST`] times `rebalance_every`; each interval
/// shortened by up to a quarter at random, so that the members' reads
/// spread out. A balanced group of 300 members read the group 300 times a
/// second, most of the server's work.
struct Cadence {
    base: Duration,
    every: Duration,
    next: tokio::time::Instant,
}

/// How many times `rebalance_every` a quiet member waits at most between
/// two reads: what a dead member's partitions may wait, after their
/// leases ran out, for a member to notice them (at most 4 s by default).
const QUIET_READS_AT_MOST: u32 = 4;

impl Cadence {
    fn new(base: Duration) -> Cadence {
        Cadence {
            base,
            every: base,
            // The first read at once.
            next: tokio::time::Instant::now(),
        }
    }

    fn after(&mut self, quiet: bool) {
        self.every = if quiet {
            (self.every * 2).min(self.base * QUIET_READS_AT_MOST)
        } else {
            self.base
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
            .insert(p, term);
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
    /// they persist) and retried at the next tick. True when the read
    /// succeeded and changed nothing (see [`Cadence`]).
    async fn rebalance(&mut self) -> bool {
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
                return false;
            }
        };
        if !read.conflicts.is_empty() {
            self.refuse(&read.conflicts);
            return false;
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
        let same_members = others == self.others;
        view.members
            .extend(std::mem::replace(&mut self.others, others));
        let plan = plan(&self.config.member, &view, &held, &standing, settled);
        // A member over its share waits for standbys to hand over to: it
        // keeps looking at `rebalance_every`.
        let quiet = same_members
            && held.len() <= plan.share
            && plan.stand.is_empty()
            && plan.unstand.is_empty()
            && plan.resign.is_empty();
        if !quiet {
            tracing::debug!(group = %self.config.group, member = %self.config.member, members = plan.members, share = plan.share, held = held.len(), stand = ?plan.stand, unstand = ?plan.unstand, resign = ?plan.resign, "rebalancing");
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
        quiet
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
        if self.reader.as_ref().is_none_or(|r| r.client().is_closed()) {
            self.reader = Some(match self.config.backend {
                Backend::Session => Reader::Listening(self.open_reader().await?),
                Backend::Lease => Reader::Pooled(
                    self.config
                        .options
                        .connect(&format!("partitions:{}", self.config.group))
                        .await?,
                ),
            });
        }
        let client = self.reader.as_ref().expect("BUG: opened above").client();
        let bound = Duration::from_secs(5).max(self.config.rebalance_every);
        match tokio::time::timeout(
            bound,
            read(
                client,
                self.config.options.schema_name().as_str(),
                &self.roles,
                Some(&self.config.member),
            ),
        )
        .await
        {
            Ok(r) => r,
            Err(_) => Err(Error::connection_lost("read the partition group")),
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

/// The connection that reads the group; see [`Driver::reader`].
enum Reader {
    Listening(Client),
    Pooled(crate::conn::DedicatedConnection),
}

impl Reader {
    fn client(&self) -> &Client {
        match self {
            Reader::Listening(c) => c,
            Reader::Pooled(c) => c.client(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quiet_reads_slow_down_to_four_intervals_and_any_change_restores_the_pace() {
        let base = Duration::from_secs(1);
        let mut c = Cadence::new(base);
        let mut seen = Vec::new();
        for quiet in [true, true, true, true, false, true] {
            let before = tokio::time::Instant::now();
            c.after(quiet);
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
        assert_eq!(seen, [2, 4, 4, 4, 1, 2]);
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
