//! Advisory-lock keys.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::error::{shown, Error, Result};

/// The longest name [`LockKey::from_name`] accepts, in bytes (64 KiB).
pub const MAX_KEY_NAME_BYTES: usize = 64 * 1024;

/// The prefix hashed in front of every name, so pgelect's keys do not
/// coincide with a plain SHA-256 of the same text used elsewhere.
const NAME_DOMAIN: &str = "pgelect:";

/// An advisory-lock key.
///
/// PostgreSQL has two advisory-lock key spaces that never collide with each
/// other: one `bigint`, and one pair of `integer`s (see
/// [Advisory Lock Functions](https://www.postgresql.org/docs/current/functions-admin.html#FUNCTIONS-ADVISORY-LOCKS)).
/// `LockKey` names a key in either, so that pgelect can share locks with code
/// that already uses the two-integer form.
///
/// Keys made from names use a stable, documented hash that SQL computes too:
/// the first 8 bytes of `SHA-256("pgelect:" || name)` (name in UTF-8), read
/// as a big-endian signed 64-bit integer. In SQL that is
/// `pgelect.key(name)`; a psql user or another language can therefore take
/// the same lock.
///
/// ```
/// use pgelect::LockKey;
///
/// let a = LockKey::from_name("nightly-report").unwrap();
/// assert_eq!(a, LockKey::from_name("nightly-report").unwrap());
/// assert_ne!(a, LockKey::from_name("nightly-report ").unwrap());
/// assert!(LockKey::from_name("").is_err());
/// assert!(LockKey::from_name("a\0b").is_err());
///
/// assert_eq!(LockKey::from_i64(42).to_string(), "42");
/// assert_eq!(LockKey::from_pair(1, 2).to_string(), "(1,2)");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LockKey {
    /// A key in the `bigint` key space.
    Single(i64),
    /// A key in the two-`integer` key space.
    Pair(i32, i32),
}

impl LockKey {
    /// A key in the `bigint` key space.
    pub const fn from_i64(key: i64) -> LockKey {
        LockKey::Single(key)
    }

    /// A key in the two-`integer` key space (distinct from every `bigint` key).
    pub const fn from_pair(high: i32, low: i32) -> LockKey {
        LockKey::Pair(high, low)
    }

    /// A key hashed from a name, identical to SQL `pgelect.key(name)`.
    ///
    /// Fails for an empty name, a name with a NUL character (PostgreSQL text
    /// cannot hold one), or one longer than [`MAX_KEY_NAME_BYTES`].
    pub fn from_name(name: &str) -> Result<LockKey> {
        validate_key_name(name)?;
        Ok(LockKey::Single(hash_name(name)))
    }

    /// A key folded from a UUID and a namespace: the UUID's two 64-bit halves
    /// and the namespace, combined with XOR.
    ///
    /// Use one namespace per family of locks (say, one for "job" locks and
    /// another for "tenant" locks) so that the same UUID locks different keys
    /// in each family. Two UUIDs may fold to one key; that only serialises
    /// unrelated work, never breaks mutual exclusion.
    ///
    /// ```
    /// use pgelect::LockKey;
    /// let id = uuid::Uuid::from_u128(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
    /// assert_ne!(LockKey::from_uuid(1, id), LockKey::from_uuid(2, id));
    /// ```
    pub fn from_uuid(namespace: u64, id: uuid::Uuid) -> LockKey {
        let v = id.as_u128();
        let folded = ((v >> 64) as u64) ^ (v as u64) ^ namespace;
        LockKey::Single(folded as i64)
    }

    /// The SQL argument list for this key, with parameters starting at `$first`:
    /// `$1::int8` or `$1::int4, $2::int4`.
    pub(crate) fn sql_args(&self, first: usize) -> String {
        match self {
            LockKey::Single(_) => format!("${first}::int8"),
            LockKey::Pair(..) => format!("${first}::int4, ${}::int4", first + 1),
        }
    }

    /// The values matching [`LockKey::sql_args`].
    pub(crate) fn params(&self) -> Vec<KeyParam> {
        match *self {
            LockKey::Single(k) => vec![KeyParam::I64(k)],
            LockKey::Pair(a, b) => vec![KeyParam::I32(a), KeyParam::I32(b)],
        }
    }

    /// The `(classid, objid, objsubid)` under which `pg_locks` shows this key.
    pub(crate) fn pg_locks_ids(&self) -> (u32, u32, i16) {
        match *self {
            LockKey::Single(k) => (((k as u64) >> 32) as u32, k as u64 as u32, 1),
            LockKey::Pair(a, b) => (a as u32, b as u32, 2),
        }
    }
}

/// One bound value of a key.
#[derive(Clone, Copy, Debug)]
pub(crate) enum KeyParam {
    I64(i64),
    I32(i32),
}

impl KeyParam {
    pub(crate) fn as_sql(
        &self,
    ) -> (
        &(dyn tokio_postgres::types::ToSql + Sync),
        tokio_postgres::types::Type,
    ) {
        match self {
            KeyParam::I64(v) => (v, tokio_postgres::types::Type::INT8),
            KeyParam::I32(v) => (v, tokio_postgres::types::Type::INT4),
        }
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockKey::Single(k) => write!(f, "{k}"),
            LockKey::Pair(a, b) => write!(f, "({a},{b})"),
        }
    }
}

impl From<i64> for LockKey {
    fn from(k: i64) -> Self {
        LockKey::Single(k)
    }
}

impl From<(i32, i32)> for LockKey {
    fn from((a, b): (i32, i32)) -> Self {
        LockKey::Pair(a, b)
    }
}

/// The hash of `name` in a key family of its own, `domain` (such as
/// `"pgelect-semaphore:"`): the first 8 bytes of `SHA-256(domain || name)` as
/// a big-endian signed integer. A domain that does not start with `pgelect:`
/// never yields the hash input of a [`LockKey::from_name`] key.
pub(crate) fn hash_in_domain(domain: &str, name: &str) -> i64 {
    let mut h = Sha256::new();
    h.update(domain.as_bytes());
    h.update(name.as_bytes());
    let digest = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

/// Checks a name as [`LockKey::from_name`] does; `what` names it in the error.
pub(crate) fn validate_name(what: &'static str, name: &str) -> Result<()> {
    validate_key_name(name).map_err(|e| match e {
        Error::InvalidName { shown, reason, .. } => Error::InvalidName {
            what,
            shown,
            reason,
        },
        other => other,
    })
}

fn validate_key_name(name: &str) -> Result<()> {
    let refuse = |reason: String| {
        Err(Error::InvalidName {
            what: "lock name",
            shown: shown(name),
            reason,
        })
    };
    if name.is_empty() {
        return refuse("it is empty; give a non-empty name".into());
    }
    if name.contains('\0') {
        return refuse("it contains a NUL character, which PostgreSQL text cannot hold".into());
    }
    if name.len() > MAX_KEY_NAME_BYTES {
        return refuse(format!(
            "it is {} bytes long; the limit is {MAX_KEY_NAME_BYTES}",
            name.len()
        ));
    }
    Ok(())
}

fn hash_name(name: &str) -> i64 {
    hash_in_domain(NAME_DOMAIN, name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn name_hash_is_stable() {
        // Pinned values: changing the hash would move every user's locks.
        // Computed independently with: printf 'pgelect:%s' NAME | sha256sum
        assert_eq!(hash_name("leader"), 0xe64f_d775_b0ad_be20_u64 as i64);
        let digest = Sha256::digest(b"pgelect:leader");
        let expect = i64::from_be_bytes(digest[..8].try_into().unwrap());
        assert_eq!(hash_name("leader"), expect);
    }

    #[test]
    fn names_are_validated() {
        assert!(LockKey::from_name("").is_err());
        assert!(LockKey::from_name("x\0").is_err());
        assert!(LockKey::from_name(&"x".repeat(MAX_KEY_NAME_BYTES)).is_ok());
        let too_long = LockKey::from_name(&"x".repeat(MAX_KEY_NAME_BYTES + 1)).unwrap_err();
        assert!(too_long.to_string().contains("limit"), "{too_long}");
        assert!(LockKey::from_name("   ").is_ok());
        assert!(LockKey::from_name("ключ🔒").is_ok());
    }

    #[test]
    fn pg_locks_ids_split_the_bigint() {
        assert_eq!(
            LockKey::from_i64(-1).pg_locks_ids(),
            (u32::MAX, u32::MAX, 1)
        );
        assert_eq!(LockKey::from_i64(1 << 32 | 7).pg_locks_ids(), (1, 7, 1));
        assert_eq!(LockKey::from_pair(-1, 3).pg_locks_ids(), (u32::MAX, 3, 2));
    }

    #[test]
    fn uuid_fold_uses_namespace() {
        let id = uuid::Uuid::from_u128(5 << 64 | 3);
        assert_eq!(LockKey::from_uuid(0, id), LockKey::Single(6));
        assert_eq!(LockKey::from_uuid(6, id), LockKey::Single(0));
    }
}
