//! `LockKey::from_name` and SQL `pgelect.key(name)` compute the same key.

use pgelect::{ConnectOptions, LockKey};
use pgelect_testkit::TestDb;
use tokio_postgres::types::Type;

/// At least 1,000 names: ASCII, Unicode in several scripts and planes,
/// combining marks, whitespace-only, quotes and backslashes, control
/// characters, and 10 kB names.
fn names() -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for i in 0..640 {
        names.push(format!("job-{i}"));
    }
    let samples = [
        "leader",
        "Leader",
        "leader ",
        " leader",
        "a",
        "ä",
        "a\u{308}",
        "ключ",
        "锁",
        "🔒",
        "🔒🔑",
        "👩‍👩‍👧",
        "مفتاح",
        "कुंजी",
        "\u{FEFF}",
        "\u{10FFFF}",
        "'",
        "\"",
        "\\",
        "''",
        "a'b\"c\\d",
        "$1",
        "%s",
        "line\nbreak",
        "tab\there",
        "\u{1}",
        "\u{7f}",
        "NULL",
    ];
    for s in samples {
        names.push(s.to_owned());
    }
    for ws in [
        " ", "  ", "\t", "\n", "\r\n", " \t\n", "\u{a0}", "\u{3000}", "\u{2028}",
    ] {
        names.push(ws.to_owned());
        names.push(ws.repeat(50));
    }
    for i in 0..300u32 {
        // Code points across the BMP and beyond, skipping surrogates and NUL.
        let c = char::from_u32(0x80 + i * 211).unwrap_or('x');
        let d = char::from_u32(0x1_0000 + i * 977).unwrap_or('y');
        names.push(format!("{c}{i}{d}"));
    }
    for i in 0..20 {
        names.push(format!("{i}").repeat(10 * 1024));
        names.push("é".repeat(5 * 1024 + i)); // 2 bytes each: > 10 kB
    }
    names.push("🔒".repeat(2600)); // 4 bytes each
    names.push(" ".repeat(10 * 1024));
    names
}

#[tokio::test]
async fn rust_and_sql_compute_the_same_keys() {
    let db = TestDb::new("keys").await;
    let options = ConnectOptions::from_url(&db.url()).unwrap();
    pgelect::migrate(&options).await.unwrap();
    let client = db.connect().await;

    let names = names();
    assert!(names.len() >= 1000, "{}", names.len());
    let rows = client
        .query_typed(
            "SELECT n.ord::int8, pgelect.key(n.name)
               FROM unnest($1::text[]) WITH ORDINALITY AS n(name, ord)
              ORDER BY n.ord",
            &[(&names, Type::TEXT_ARRAY)],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), names.len());
    let mut distinct = std::collections::HashSet::new();
    for (row, name) in rows.iter().zip(&names) {
        let sql: i64 = row.get(1);
        let rust = LockKey::from_name(name).unwrap();
        assert_eq!(
            rust,
            LockKey::from_i64(sql),
            "name {:?} ({} bytes)",
            name.chars().take(20).collect::<String>(),
            name.len()
        );
        distinct.insert(sql);
    }
    assert_eq!(
        distinct.len(),
        names.len(),
        "distinct names give distinct keys"
    );
}

#[tokio::test]
async fn sql_key_refuses_the_empty_name() {
    let db = TestDb::new("keys_empty").await;
    let options = ConnectOptions::from_url(&db.url()).unwrap();
    pgelect::migrate(&options).await.unwrap();
    let client = db.connect().await;

    let err = client
        .query_typed("SELECT pgelect.key('')", &[])
        .await
        .unwrap_err();
    assert_eq!(err.code().map(|c| c.code()), Some("22023"), "{err}");
    assert!(LockKey::from_name("").is_err());
    // STRICT: NULL in, NULL out.
    let row = client
        .query_typed_one("SELECT pgelect.key(NULL)", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, Option<i64>>(0), None);
}
