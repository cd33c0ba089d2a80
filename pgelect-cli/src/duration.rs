//! Durations on the command line: `500ms`, `15s`, `2m`, `1h`, or a bare number
//! of seconds.

use std::time::Duration;

/// Parses a positive duration; zero, negative and malformed values are
/// refused with a message that shows the accepted forms.
pub fn parse_positive(text: &str) -> Result<Duration, String> {
    let d = parse(text)?;
    if d.is_zero() {
        return Err(format!(
            "{text:?} is zero; give a positive duration such as 500ms, 15s or 2m"
        ));
    }
    Ok(d)
}

fn parse(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    if t.starts_with('-') {
        return Err(format!(
            "{text:?} is negative; give a positive duration such as 500ms, 15s or 2m"
        ));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number.parse().map_err(|_| {
        format!("{text:?} is not a duration; use forms such as 500ms, 15s, 2m or 1h")
    })?;
    let seconds = match unit.trim() {
        "ms" => value / 1000.0,
        "" | "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {text:?}; use ms, s, m or h"
            ))
        }
    };
    if !seconds.is_finite() || seconds > 365.0 * 86400.0 {
        return Err(format!("{text:?} is too long"));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// Renders a duration the way it is typed: `1.5s`, `250ms`, `2m`.
pub fn show(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms.is_multiple_of(60_000) {
        format!("{}m", ms / 60_000)
    } else if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{:.3}s", d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_documented_forms() {
        assert_eq!(parse_positive("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_positive("15s"), Ok(Duration::from_secs(15)));
        assert_eq!(parse_positive("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_positive("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_positive("3"), Ok(Duration::from_secs(3)));
    }

    #[test]
    fn refuses_nonsense() {
        for bad in ["0", "0s", "-1s", "abc", "5 parsecs", "", "1e999"] {
            let e = parse_positive(bad).unwrap_err();
            assert!(!e.is_empty(), "{bad}");
        }
        assert!(parse_positive("-1s").unwrap_err().contains("negative"));
        assert!(parse_positive("0s").unwrap_err().contains("zero"));
    }

    #[test]
    fn shows_round_values() {
        assert_eq!(show(Duration::from_millis(250)), "250ms");
        assert_eq!(show(Duration::from_secs(120)), "2m");
        assert_eq!(show(Duration::from_secs(15)), "15s");
    }
}
