//! Takes the settings pgelect handles itself (TLS) out of a connection
//! string before the rest goes to the driver, which does not know them.
//!
//! Both libpq forms are read: a URL's query (`?sslmode=verify-full&…`,
//! values percent-decoded) and key/value pairs (`sslmode=verify-full
//! sslrootcert='/a b/ca.crt'`, values quoted with `'` and escaped with `\`).
//! Everything else is left exactly as written.

/// Removes the pairs whose key is in `keys` from `text` and returns the
/// rest with the pairs taken, in order. Text that cannot be split (an
/// unterminated quote) is returned whole, for the driver to report.
pub(crate) fn take(text: &str, keys: &[&str]) -> (String, Vec<(String, String)>) {
    let is_url = text.starts_with("postgres://") || text.starts_with("postgresql://");
    if is_url {
        take_from_url(text, keys)
    } else {
        take_from_pairs(text, keys).unwrap_or_else(|| (text.to_owned(), Vec::new()))
    }
}

fn take_from_url(text: &str, keys: &[&str]) -> (String, Vec<(String, String)>) {
    let Some((head, query)) = text.split_once('?') else {
        return (text.to_owned(), Vec::new());
    };
    let mut kept = Vec::new();
    let mut taken = Vec::new();
    for part in query.split('&') {
        let (k, v) = part.split_once('=').unwrap_or((part, ""));
        let key = percent_decode(k);
        if keys.contains(&key.as_str()) {
            taken.push((key, percent_decode(v)));
        } else if !part.is_empty() {
            kept.push(part);
        }
    }
    let rest = if kept.is_empty() {
        head.to_owned()
    } else {
        format!("{head}?{}", kept.join("&"))
    };
    (rest, taken)
}

/// `%XX` decoded; a malformed escape is kept as written. Invalid UTF-8 is
/// replaced (file paths here are expected to be UTF-8).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
            if let Some(b) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The key/value form, as libpq's `conninfo_parse` reads it.
fn take_from_pairs(text: &str, keys: &[&str]) -> Option<(String, Vec<(String, String)>)> {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let at = |i: usize| chars.get(i).map(|&(_, c)| c);
    let offset = |i: usize| chars.get(i).map_or(text.len(), |&(o, _)| o);
    let mut i = 0;
    let mut rest = String::new();
    let mut copied_to = 0;
    let mut taken = Vec::new();
    loop {
        while at(i).is_some_and(char::is_whitespace) {
            i += 1;
        }
        let Some(_) = at(i) else { break };
        let start = i;
        let mut key = String::new();
        while let Some(c) = at(i) {
            if c == '=' || c.is_whitespace() {
                break;
            }
            key.push(c);
            i += 1;
        }
        while at(i).is_some_and(char::is_whitespace) {
            i += 1;
        }
        if at(i) != Some('=') {
            return None;
        }
        i += 1;
        while at(i).is_some_and(char::is_whitespace) {
            i += 1;
        }
        let mut value = String::new();
        if at(i) == Some('\'') {
            i += 1;
            loop {
                match at(i) {
                    None => return None,
                    Some('\\') => {
                        value.push(at(i + 1)?);
                        i += 2;
                    }
                    Some('\'') => {
                        i += 1;
                        break;
                    }
                    Some(c) => {
                        value.push(c);
                        i += 1;
                    }
                }
            }
        } else {
            while let Some(c) = at(i) {
                if c.is_whitespace() {
                    break;
                }
                if c == '\\' {
                    value.push(at(i + 1)?);
                    i += 2;
                    continue;
                }
                value.push(c);
                i += 1;
            }
        }
        if keys.contains(&key.as_str()) {
            rest.push_str(&text[copied_to..offset(start)]);
            copied_to = offset(i);
            taken.push((key, value));
        }
    }
    rest.push_str(&text[copied_to..]);
    Some((rest.trim().to_owned(), taken))
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEYS: [&str; 2] = ["sslmode", "sslrootcert"];

    #[test]
    fn url_keys_are_taken_and_decoded_the_rest_kept() {
        let (rest, taken) = take(
            "postgres://u:p%40w@h:5432/db?application_name=x&sslmode=verify-full&sslrootcert=%2Ftmp%2Fa%20b.pem&connect_timeout=3",
            &KEYS,
        );
        assert_eq!(
            rest,
            "postgres://u:p%40w@h:5432/db?application_name=x&connect_timeout=3"
        );
        assert_eq!(
            taken,
            vec![
                ("sslmode".to_owned(), "verify-full".to_owned()),
                ("sslrootcert".to_owned(), "/tmp/a b.pem".to_owned())
            ]
        );
        let (rest, taken) = take("postgresql://h/db?sslmode=require", &KEYS);
        assert_eq!(rest, "postgresql://h/db");
        assert_eq!(taken.len(), 1);
        let (rest, taken) = take("postgres://h/db", &KEYS);
        assert_eq!((rest.as_str(), taken.len()), ("postgres://h/db", 0));
    }

    #[test]
    fn pairs_are_taken_with_quotes_and_escapes() {
        let (rest, taken) = take(
            "host=db sslmode = verify-ca password='a b\\'c' sslrootcert='/x y/ca.pem' dbname=app",
            &KEYS,
        );
        assert_eq!(rest, "host=db  password='a b\\'c'  dbname=app");
        assert_eq!(
            taken,
            vec![
                ("sslmode".to_owned(), "verify-ca".to_owned()),
                ("sslrootcert".to_owned(), "/x y/ca.pem".to_owned())
            ]
        );
        // Unterminated: left to the driver, which reports it.
        let (rest, taken) = take("host=db password='abc", &KEYS);
        assert_eq!((rest.as_str(), taken.len()), ("host=db password='abc", 0));
    }

    #[test]
    fn malformed_percent_escapes_are_kept() {
        assert_eq!(percent_decode("a%2"), "a%2");
        assert_eq!(percent_decode("a%zzb"), "a%zzb");
        assert_eq!(percent_decode("%41%42"), "AB");
    }
}
