//! How a new fencing term is computed, in SQL for the backends and in Rust
//! for the tests: one rule for every backend.
//!
//! A term only rises on one server, but a failover can lose the last bumps
//! the old primary committed (asynchronous replication): `old + 1` on the
//! new primary would then hand out a term some worker already holds. The
//! server's WAL timeline goes up by one at every promotion, and a
//! promotion is the only way such a loss happens, so the timeline is
//! folded into the high 32 bits:
//!
//! ```text
//! next = greatest(old + 1, (timeline - 1) << 32)
//! ```
//!
//! Every term handed out on timeline `t` is at least `(t - 1) << 32`, and
//! stays below `t << 32` as long as one timeline hands out fewer than 2^32
//! terms: so every term on a newer timeline is larger than every term on
//! an older one, whatever the newer primary received. Terms stay strictly
//! increasing on one server (`old + 1` at least). A server that was never
//! promoted (timeline 1) keeps the plain `old + 1` sequence: nothing changes
//! until the first failover, whose first election jumps to `2^32` or more.
//!
//! The timeline is read from the name of the WAL segment at the current
//! insert position: it is the new timeline from the moment a promoted
//! server accepts writes (`pg_control_checkpoint()` lags until the next
//! checkpoint). Both functions are executable by `PUBLIC`, so candidates
//! need no new grant.

/// The server's current WAL timeline (`bigint`), as SQL.
pub(crate) const TIMELINE_SQL: &str = "('x' || pg_catalog.substr(pg_catalog.pg_walfile_name(\
     pg_catalog.pg_current_wal_insert_lsn()), 1, 8))::bit(32)::int8";

/// The SQL condition "the lease state of the row `l` may be older than
/// what the last primary had": the row's term was handed out on an older
/// timeline than this server's (`timeline`, an SQL expression), and no
/// candidate re-armed its lease on this timeline since (`lease_timeline`).
///
/// Asynchronous replication can lose the old primary's last renewals, or
/// an election, with the promotion: the row then shows a lease that looks
/// expired (or released) while its holder still counts on its local
/// deadline. Such a row is never taken over as it reads; the lease
/// backend re-arms it first ([`rearm_lease_sql`]), the session backend
/// counts its takeover as unclean (handover delay). A missing row (`l` of
/// an outer join, all NULL) is never stale.
pub(crate) fn stale_row_sql(l: &str, timeline: &str) -> String {
    format!(
        "({l}.term IS NOT NULL AND greatest(coalesce({l}.lease_timeline, 0), ({l}.term >> 32) + 1) < ({timeline}))"
    )
}

/// The SET list that re-arms the lease of a row `l` that [`stale_row_sql`]
/// found stale: the lease runs for a full TTL from now (the longer of the
/// row's last lease length and `$ttl_ms`, the candidate's own TTL), and the
/// row is marked as re-armed on `timeline`. The holder and the term stay:
/// a holder that reaches this server renews as before. Now is after the
/// promotion, and the promotion after the old primary's last renewal, so
/// any holder's local deadline ends before the re-armed lease does.
pub(crate) fn rearm_lease_sql(l: &str, ttl_ms: &str, timeline: &str) -> String {
    format!(
        "lease_until = greatest({l}.lease_until, now() + greatest(coalesce({l}.lease_until - {l}.renewed_at, interval '0'), ({ttl_ms}) * interval '1 millisecond')),
         lease_timeline = ({timeline})::int4"
    )
}

/// The previous holder a session-backend election reports for the row
/// `l` (an SQL expression), which makes the takeover unclean (it waits the
/// handover delay): the holder it names while that holder's lease still
/// runs on the server's clock; for a row that [`stale_row_sql`] finds
/// stale, the holder or a placeholder whatever the lease says (a released
/// row read on a promoted server may be older than an election the old
/// primary committed and never sent, and its expiry may lack renewals);
/// otherwise NULL: the takeover is clean.
///
/// A holder whose lease expired on the server's clock is past its local
/// deadline: the deadline counts from a renewal sent before the server set
/// that expiry, and ends the safety margin (the clock drift allowed)
/// before it. So it has stopped acting, as the lease backend relies on
/// when it acts at once on an expired lease, and the handover delay would
/// only add to a failover after a partition or a frozen leader (the model
/// check's sessions take the same rule).
pub(crate) fn previous_holder_sql(l: &str) -> String {
    format!(
        "CASE WHEN {} THEN coalesce({l}.holder, '{STALE_HOLDER}')
              WHEN {l}.lease_until < now() THEN NULL
              ELSE {l}.holder END",
        stale_row_sql(l, TIMELINE_SQL)
    )
}

/// What [`previous_holder_sql`] reports for a stale row that names nobody.
pub(crate) const STALE_HOLDER: &str = "(unknown: the row was written before a promotion)";

/// The SQL expression of the term that follows the term `old` (an SQL
/// expression; `0` for a role without a row yet) on this server: see the
/// module docs.
pub(crate) fn next_term_sql(old: &str) -> String {
    format!("greatest(({old}) + 1, (({TIMELINE_SQL}) - 1) << 32)")
}

/// The term that follows `old` on a server writing WAL on `timeline`: the
/// Rust twin of [`next_term_sql`], for tests and the simulation.
#[cfg(test)]
pub(crate) fn next_term(old: i64, timeline: u32) -> i64 {
    (old + 1).max((i64::from(timeline) - 1) << 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeline_one_keeps_plus_one() {
        assert_eq!(next_term(0, 1), 1);
        assert_eq!(next_term(1, 1), 2);
        assert_eq!(next_term(41, 1), 42);
    }

    #[test]
    fn a_promotion_jumps_to_the_new_timeline() {
        assert_eq!(next_term(7, 2), 1 << 32);
        assert_eq!(next_term((1 << 32) + 5, 2), (1 << 32) + 6);
        assert_eq!(next_term((1 << 32) + 5, 4), 3 << 32);
        // A lower timeline (a restored dump on a fresh server) never lowers a term.
        assert_eq!(next_term((3 << 32) + 1, 1), (3 << 32) + 2);
    }

    /// The failover the rule is for, over many random histories: the old
    /// primary hands out terms the new primary never sees (a lost tail),
    /// then the new primary, one timeline up, goes on from what it
    /// received. No term is handed out twice, and every term after the
    /// promotion is larger than every term before it.
    #[test]
    fn lost_bumps_are_never_handed_out_again() {
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut rand = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..10_000 {
            let mut timeline = 1 + rand(3) as u32;
            // The row on the replica: fewer than 2^32 terms per timeline.
            let mut received = (i64::from(timeline - 1) << 32) + rand(1 << 20) as i64;
            let mut given = vec![];
            for _failover in 0..4 {
                // On the primary: some bumps replicated, then a lost tail.
                let mut term = received;
                let replicated = rand(5);
                let lost = 1 + rand(5);
                for i in 0..replicated + lost {
                    term = next_term(term, timeline);
                    given.push(term);
                    if i < replicated {
                        received = term;
                    }
                }
                let before = *given.iter().max().unwrap();
                timeline += 1 + rand(2) as u32; // a promotion, maybe two
                let first_after = next_term(received, timeline);
                assert!(first_after > before, "{first_after} <= {before}");
            }
            let mut sorted = given.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), given.len(), "a term was handed out twice");
        }
    }

    /// The negative control: the old rule hands a lost term out again.
    #[test]
    fn plus_one_alone_reuses_a_lost_term() {
        let received = 1;
        let lost = received + 1; // committed on the old primary only
        let old_rule = received + 1; // on the new primary
        assert_eq!(old_rule, lost);
        assert!(next_term(received, 2) > lost);
    }

    #[test]
    fn sql_names_both_parts() {
        let sql = next_term_sql("l.term");
        assert!(sql.starts_with("greatest((l.term) + 1, "));
        assert!(sql.contains("pg_current_wal_insert_lsn()"));
        assert!(sql.ends_with("- 1) << 32)"));
    }
}
