//! The pure rules of a member: from one snapshot of the group (who leads
//! what, which members live, which standbys are ready) and what this member
//! holds and stands for, what it should stand for, stop standing for and
//! hand over. No I/O, no clock: unit-tested below.

use std::collections::{BTreeMap, BTreeSet};

/// One partition as the rebalancing statement read it; members are
/// indices into [`GroupView::names`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PartitionView {
    /// The leader row's holder while its lease runs (`None`: released,
    /// never led, or expired).
    pub(crate) holder: Option<u32>,
    /// Members with a live, still polling registration for the partition's
    /// role (may include the holder itself).
    pub(crate) ready: Vec<u32>,
}

/// The group as one statement read it. Every name appears once, in
/// `names`; the partitions refer to them by index, so that a member reads,
/// counts and compares thousands of holders as integers (at 1,000 members
/// of 1,000 partitions, comparing and copying the names was most of the
/// members' CPU).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct GroupView {
    /// Every node the view names: live members and holders.
    pub(crate) names: Vec<String>,
    /// Indexed like `names`: whether the node is a live member (a node
    /// with a registry row of one of the group's roles whose backend the
    /// server shows alive, or a lease holder).
    pub(crate) live: Vec<bool>,
    /// Indexed by partition.
    pub(crate) partitions: Vec<PartitionView>,
}

impl GroupView {
    /// The index of `name` (one pass over the names: once per read).
    pub(crate) fn index(&self, name: &str) -> Option<u32> {
        self.names.iter().position(|n| n == name).map(|i| i as u32)
    }

    /// The name at `i` (an index the view holds).
    pub(crate) fn name(&self, i: u32) -> &str {
        &self.names[i as usize]
    }

    /// Whether the node at `i` is a live member.
    pub(crate) fn is_live(&self, i: u32) -> bool {
        self.live.get(i as usize).copied().unwrap_or(false)
    }

    /// The live members' names.
    pub(crate) fn members(&self) -> impl Iterator<Item = &str> + '_ {
        self.names
            .iter()
            .zip(&self.live)
            .filter(|(_, l)| **l)
            .map(|(n, _)| n.as_str())
    }

    /// How many live members the view shows.
    pub(crate) fn member_count(&self) -> usize {
        self.live.iter().filter(|l| **l).count()
    }

    /// Counts `name` as a live member (added when the view lacks it).
    pub(crate) fn add_member(&mut self, name: String) {
        match self.index(&name) {
            Some(i) => self.live[i as usize] = true,
            None => {
                self.names.push(name);
                self.live.push(true);
            }
        }
    }

    /// The index of `name`, added (not live) when the view lacks it.
    #[cfg(test)]
    pub(crate) fn intern(&mut self, name: &str) -> u32 {
        self.index(name).unwrap_or_else(|| {
            self.names.push(name.to_owned());
            self.live.push(false);
            (self.names.len() - 1) as u32
        })
    }

    /// Test set-up: partitions held by `holders`, the live `members`.
    #[cfg(test)]
    pub(crate) fn of(holders: &[Option<&str>], members: &[&str]) -> Self {
        let mut v = GroupView::default();
        for m in members {
            v.add_member((*m).to_owned());
        }
        v.partitions = holders
            .iter()
            .map(|h| PartitionView {
                holder: h.map(|h| v.intern(h)),
                ready: Vec::new(),
            })
            .collect();
        v
    }

    /// Test set-up: the members ready to take partition `p`.
    #[cfg(test)]
    pub(crate) fn set_ready(&mut self, p: usize, names: &[&str]) {
        let ready = names.iter().map(|n| self.intern(n)).collect();
        self.partitions[p].ready = ready;
    }
}

/// What a member should do now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Live members counted (this one included).
    pub(crate) members: usize,
    /// ⌈N / members⌉.
    pub(crate) share: usize,
    /// Standbys to start.
    pub(crate) stand: Vec<u32>,
    /// Standbys to stop.
    pub(crate) unstand: Vec<u32>,
    /// Held partitions to hand over (a ready standby of another live member
    /// waits for each).
    pub(crate) resign: Vec<u32>,
    /// Whether the member has work that the next snapshots decide: it is
    /// over its share, or it is under its share and could stand for a
    /// partition it does not stand for yet (one unled, or of a member over
    /// its share), whether or not it starts that standby now.
    pub(crate) busy: bool,
}

/// ⌈n / m⌉ for m ≥ 1.
pub(crate) fn share(n: usize, members: usize) -> usize {
    n.div_ceil(members.max(1))
}

/// A stable preference of `member` for `partition` (rendezvous hashing):
/// FNV-1a of both, mixed. Members prefer different partitions, so that
/// their standbys rarely pile onto the same ones.
pub(crate) fn score(member: &str, partition: u32) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in member.bytes().chain([0xff]).chain(partition.to_le_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    // splitmix64 finaliser: FNV's low bits mix poorly for short inputs.
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The member's decision for this snapshot.
///
/// * `M` = live members ∪ {me}; share `s = ⌈N/M⌉`.
/// * A partition is *unled* when its holder is not a live member (released,
///   expired, or its member's backend is gone); held partitions count as
///   mine whatever the snapshot says (it may lag).
/// * Over its share, a member hands over `held - s` partitions, only ones
///   for which a ready standby of another live member waits (a clean
///   handoff: that standby takes it at once), least preferred first. With
///   no such standby it keeps them: handing over into the void would leave
///   a partition unled.
/// * Under its share, it stands for at most `s - held` partitions: unled
///   ones first, then, per member over its share, at most that member's
///   excess of its partitions; current standbys first (no churn), then by
///   preference. Hence `held + standing ≤ s` and a member is never granted
///   more than its share as it reads it.
/// * Not `settled` (a member joined since the last snapshot): no new
///   standbys but the announcing one.
/// * Not yet live in the snapshot and holding nothing: one standby, for
///   its favourite partition, which announces it.
pub(crate) fn plan(
    me: &str,
    view: &GroupView,
    held: &BTreeSet<u32>,
    standing: &BTreeSet<u32>,
    settled: bool,
) -> Plan {
    let n = view.partitions.len();
    let me_at = view.index(me);
    let me_live = me_at.is_some_and(|i| view.is_live(i));
    let m = view.member_count() + usize::from(!me_live);
    let s = share(n, m);
    // Another live member than me.
    let other = |i: u32| Some(i) != me_at && view.is_live(i);

    // Partitions led by each other live member (indexed by name), and the
    // unled ones.
    let mut counts = vec![0usize; view.names.len()];
    let mut unled = Vec::new();
    for (p, v) in view.partitions.iter().enumerate() {
        let p = p as u32;
        if held.contains(&p) {
            continue;
        }
        match v.holder {
            Some(h) if other(h) => counts[h as usize] += 1,
            // A row naming me that I do not hold: a leadership of mine that
            // just ended; free for anyone, me included.
            _ => unled.push(p),
        }
    }
    let count = |i: u32| counts.get(i as usize).copied().unwrap_or(0);

    let mut resign = Vec::new();
    if held.len() > s {
        // A member at or over its share stands for nothing: a fresh row of
        // one is left from a standby it stopped (rows stay fresh for a few
        // polling intervals), not a taker.
        let takes = |r: u32| other(r) && count(r) < s;
        let mut ready: Vec<u32> = held
            .iter()
            .copied()
            .filter(|&p| {
                view.partitions
                    .get(p as usize)
                    .is_some_and(|v| v.ready.iter().any(|&r| takes(r)))
            })
            .collect();
        ready.sort_by_key(|&p| (score(me, p), p));
        ready.truncate(held.len() - s);
        resign = ready;
    }

    // A member that holds nothing and is not yet live in the snapshot (its
    // registration not written or not read yet) announces itself before it
    // campaigns: it stands for its favourite partition only (below). Members
    // started together would otherwise each count only themselves, take the
    // whole group as their share and stand for every partition: N × M
    // standbys contending for the same rows, where one read later each
    // counts the others and stands for ⌈N/M⌉.
    let announcing = held.is_empty() && !me_live;
    let capacity = if announcing {
        0
    } else {
        s.saturating_sub(held.len())
    };
    // (tier, not currently standing, preference) ascending.
    let rank = |tier: u8, p: u32| (tier, !standing.contains(&p), u64::MAX - score(me, p), p);
    let mut eligible: Vec<(u8, bool, u64, u32)> = unled.iter().map(|&p| rank(0, p)).collect();
    // Per member over its share, its excess (rare: a second pass only for
    // those).
    let mut over: BTreeMap<u32, Vec<(u8, bool, u64, u32)>> = BTreeMap::new();
    for (p, v) in view.partitions.iter().enumerate() {
        let p = p as u32;
        if let Some(h) = v
            .holder
            .filter(|&h| !held.contains(&p) && other(h) && count(h) > s)
        {
            over.entry(h).or_default().push(rank(1, p));
        }
    }
    for (h, mut mine) in over {
        mine.sort();
        mine.truncate(count(h) - s);
        eligible.extend(mine);
    }
    eligible.sort();
    // Computed before the joining members' pause below: a member that
    // waits for the count to settle is still hungry.
    let busy =
        held.len() > s || (held.len() < s && eligible.iter().any(|e| !standing.contains(&e.3)));
    // While members are still joining (the snapshot shows one that the
    // previous one did not), the share is about to come down: a member
    // keeps the standbys it has but starts none, so that members started
    // together do not each win more than their final share and then hand
    // the rest over one by one.
    if !settled {
        eligible.retain(|e| standing.contains(&e.3));
    }
    let mut desired: BTreeSet<u32> = eligible.iter().take(capacity).map(|e| e.3).collect();
    // A member that holds nothing and finds nothing to take (or announces
    // itself) stands for its favourite partition all the same: its
    // registration is what shows it live (on the lease backend nothing else
    // does), so that the others count it, their share comes down and they
    // hand over to it. Standing takes nothing from a live holder.
    if held.is_empty() && desired.is_empty() {
        let favourite =
            (0..n as u32).min_by_key(|&p| (!standing.contains(&p), u64::MAX - score(me, p), p));
        desired.extend(favourite);
    }
    Plan {
        members: m,
        share: s,
        stand: desired.difference(standing).copied().collect(),
        unstand: standing.difference(&desired).copied().collect(),
        resign,
        busy,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_holding_nothing_stands_for_one_partition_to_be_counted() {
        // Two partitions, each held by a live member within its share as
        // they count (2 members): the third, not counted yet, has nothing
        // to take but stands for one partition all the same.
        let v = view(&[Some("a"), Some("b")], &["a", "b"]);
        let p = plan("c", &v, &BTreeSet::new(), &BTreeSet::new(), true);
        assert_eq!(p.stand.len(), 1, "{p:?}");
        assert!(p.resign.is_empty());
        // Still standing for it at the next read: no churn.
        let again = plan(
            "c",
            &v,
            &BTreeSet::new(),
            &p.stand.iter().copied().collect(),
            true,
        );
        assert!(
            again.stand.is_empty() && again.unstand.is_empty(),
            "{again:?}"
        );
        // A member that holds something does not.
        let held: BTreeSet<u32> = [0].into();
        let v = view(&[None, Some("b")], &["a", "b"]);
        assert!(plan("a", &v, &held, &BTreeSet::new(), true)
            .stand
            .is_empty());
    }

    fn view(holders: &[Option<&str>], members: &[&str]) -> GroupView {
        GroupView::of(holders, members)
    }

    fn set(v: &[u32]) -> BTreeSet<u32> {
        v.iter().copied().collect()
    }

    #[test]
    fn a_member_is_busy_while_over_its_share_or_able_to_stand_for_more() {
        // Balanced: 6 partitions, 2 members with 3 each.
        let held = [
            Some("a"),
            Some("a"),
            Some("a"),
            Some("b"),
            Some("b"),
            Some("b"),
        ];
        let p = plan(
            "a",
            &view(&held, &["a", "b"]),
            &set(&[0, 1, 2]),
            &set(&[]),
            true,
        );
        assert!(!p.busy, "{p:?}");
        // Over its share once a third member counts: busy until handed over.
        let p = plan(
            "a",
            &view(&held, &["a", "b", "c"]),
            &set(&[0, 1, 2]),
            &set(&[]),
            true,
        );
        assert!(p.busy, "{p:?}");
        // Under its share with an unled partition, while members still join
        // (it starts no standby): busy all the same.
        let v = view(&[Some("a"), None, Some("b"), Some("b")], &["a", "b"]);
        let p = plan("a", &v, &set(&[0]), &set(&[]), false);
        assert!(p.stand.is_empty() && p.busy, "{p:?}");
        // ... and no longer once it stands for all it may.
        let p = plan("a", &v, &set(&[0]), &set(&[1]), true);
        assert!(!p.busy, "{p:?}");
        // More members than partitions, every partition led within the
        // share: a member leading nothing has nothing to do.
        let v = view(&[Some("a"), Some("b")], &["a", "b", "c"]);
        let p = plan("c", &v, &set(&[]), &set(&[0]), true);
        assert!(!p.busy, "{p:?}");
    }

    #[test]
    fn shares_round_up() {
        assert_eq!(share(12, 3), 4);
        assert_eq!(share(12, 5), 3);
        assert_eq!(share(1, 4), 1);
        assert_eq!(share(7, 0), 7);
    }

    #[test]
    fn an_empty_group_is_stood_for_up_to_the_share() {
        let v = view(&[None; 12], &["a", "b", "c"]);
        let p = plan("a", &v, &set(&[]), &set(&[]), true);
        assert_eq!(p.share, 4);
        assert_eq!(p.stand.len(), 4);
        assert!(p.unstand.is_empty() && p.resign.is_empty());
    }

    #[test]
    fn a_member_unknown_to_the_snapshot_counts_itself() {
        let v = view(&[Some("a"); 4], &["a"]);
        let p = plan("new", &v, &set(&[]), &set(&[]), true);
        assert_eq!((p.members, p.share), (2, 2));
        // Not live in the snapshot yet: it announces itself with one
        // standby before it campaigns for its share.
        assert_eq!(p.stand.len(), 1, "{p:?}");
        // Once the snapshot shows it: a leads 4 > 2, two of them are worth
        // standing for (the announcing standby among them).
        let v = view(&[Some("a"); 4], &["a", "new"]);
        let again = plan(
            "new",
            &v,
            &set(&[]),
            &p.stand.iter().copied().collect(),
            true,
        );
        assert_eq!(again.share, 2);
        assert_eq!(again.stand.len(), 1, "{again:?}");
        assert!(again.unstand.is_empty(), "{again:?}");
    }

    #[test]
    fn members_started_together_stand_for_one_partition_each_until_they_count_each_other() {
        // 100 members, 100 partitions, nobody registered yet: each counts
        // only itself (share 100) but stands for one partition, not 100.
        let v = view(&[None; 100], &[]);
        let total: usize = (0..100)
            .map(|i| {
                plan(&format!("m{i}"), &v, &set(&[]), &set(&[]), true)
                    .stand
                    .len()
            })
            .sum();
        assert_eq!(total, 100);
        // One read later they count each other: share 1, one standby each.
        let names: Vec<String> = (0..100).map(|i| format!("m{i}")).collect();
        let all: Vec<&str> = names.iter().map(String::as_str).collect();
        let v = view(&[None; 100], &all);
        for m in &all {
            let p = plan(m, &v, &set(&[]), &set(&[]), true);
            assert_eq!((p.share, p.stand.len()), (1, 1), "{m}: {p:?}");
        }
    }

    #[test]
    fn while_members_join_a_member_starts_no_new_standby() {
        // a and b live, 10 partitions unled: share 5.
        let v = view(&[None; 10], &["a", "b"]);
        let settled = plan("a", &v, &set(&[]), &set(&[]), true);
        assert_eq!(settled.stand.len(), 5, "{settled:?}");
        // b just appeared: a announces itself with one standby only...
        let joining = plan("a", &v, &set(&[]), &set(&[]), false);
        assert_eq!(joining.stand.len(), 1, "{joining:?}");
        // ...keeps the standbys it has, and one that holds starts none.
        let kept = plan("a", &v, &set(&[]), &set(&[3, 4]), false);
        assert!(kept.stand.is_empty() && kept.unstand.is_empty(), "{kept:?}");
        let holding = plan("a", &v, &set(&[0]), &set(&[]), false);
        assert!(holding.stand.is_empty(), "{holding:?}");
    }

    #[test]
    fn a_joiner_takes_at_most_each_members_excess() {
        // a, b, c lead 4 each; d joins: share 3, one from each.
        let mut h = Vec::new();
        for m in ["a", "b", "c"] {
            h.extend([Some(m); 4]);
        }
        let v = view(&h, &["a", "b", "c", "d"]);
        let p = plan("d", &v, &set(&[]), &set(&[]), true);
        assert_eq!(p.share, 3);
        assert_eq!(p.stand.len(), 3);
        let owners: BTreeSet<_> = p.stand.iter().map(|&x| h[x as usize].unwrap()).collect();
        assert_eq!(owners.len(), 3, "one from each: {:?}", p.stand);
    }

    #[test]
    fn over_its_share_a_member_hands_over_only_to_ready_standbys() {
        let mut v = view(&[Some("a"); 4], &["a", "b"]);
        let held = set(&[0, 1, 2, 3]);
        // Nobody waits: keep everything.
        assert!(plan("a", &v, &held, &set(&[]), true).resign.is_empty());
        // b waits for 2 (and a dead member for 3): hand over 2 only.
        v.set_ready(2, &["b", "a"]);
        v.set_ready(3, &["ghost"]);
        let p = plan("a", &v, &held, &set(&[]), true);
        assert_eq!(p.resign, vec![2]);
        v.set_ready(1, &["b"]);
        v.set_ready(0, &["b"]);
        assert_eq!(plan("a", &v, &held, &set(&[]), true).resign.len(), 2);
    }

    #[test]
    fn a_stale_row_of_a_member_at_its_share_is_no_taker() {
        // a leads 0..4, b leads 4..6 (at its share of 3 with c), c leads
        // 6..9; a fresh row of b for partition 0 is left from an old standby.
        let mut h = vec![Some("a"); 4];
        h.extend([Some("b"); 3]);
        h.extend([Some("c"); 2]);
        let mut v = view(&h, &["a", "b", "c"]);
        v.set_ready(0, &["b"]);
        let held = set(&[0, 1, 2, 3]);
        assert!(plan("a", &v, &held, &set(&[]), true).resign.is_empty());
        // c, under its share, waits for 1: that one goes.
        v.set_ready(1, &["c"]);
        assert_eq!(plan("a", &v, &held, &set(&[]), true).resign, vec![1]);
    }

    #[test]
    fn a_dead_members_partitions_are_unled() {
        let v = view(
            &[Some("a"), Some("a"), Some("dead"), Some("dead")],
            &["a", "b"],
        );
        let p = plan("b", &v, &set(&[]), &set(&[]), true);
        assert_eq!(p.stand, vec![2, 3]);
    }

    #[test]
    fn standing_and_held_never_exceed_the_share() {
        let v = view(&[None; 10], &["a", "b", "c"]);
        let held = set(&[0, 1]);
        let p = plan("a", &v, &held, &set(&[5, 6, 7]), true);
        // share 4, held 2: two standbys, current ones kept first.
        let after: BTreeSet<u32> = set(&[5, 6, 7])
            .difference(&p.unstand.iter().copied().collect())
            .copied()
            .chain(p.stand.iter().copied())
            .collect();
        assert_eq!(after.len(), 2);
        assert!(p.stand.is_empty());
        assert_eq!(p.unstand.len(), 1);
    }

    #[test]
    fn members_at_their_share_are_left_alone() {
        let v = view(&[Some("a"), Some("a"), Some("b"), Some("b")], &["a", "b"]);
        let p = plan("a", &v, &set(&[0, 1]), &set(&[]), true);
        assert_eq!(
            p,
            Plan {
                members: 2,
                share: 2,
                ..Plan::default()
            }
        );
    }

    #[test]
    fn preferences_differ_between_members() {
        let a: Vec<u64> = (0..8).map(|p| score("a", p)).collect();
        let b: Vec<u64> = (0..8).map(|p| score("b", p)).collect();
        assert_ne!(a, b);
        assert_eq!(score("a", 3), score("a", 3));
    }
}
