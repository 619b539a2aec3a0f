//! Integers of requests as JSON defines them: a number with no fraction.
//! JSON (and JSON Schema's `integer`) does not tell `5` from `5.0`; serde
//! does, so integer request fields read through these functions and accept
//! `5.0` as `5`. A fraction, a negative value or one past the type's range
//! is still refused.

use serde::de::{Deserializer, Error, Visitor};

/// Largest float that is still an exact integer (2^53).
const EXACT_FLOAT_MAX: f64 = 9_007_199_254_740_992.0;

struct Whole;

impl Visitor<'_> for Whole {
    type Value = u64;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a non-negative integer")
    }

    fn visit_u64<E: Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }

    fn visit_i64<E: Error>(self, v: i64) -> Result<u64, E> {
        u64::try_from(v).map_err(|_| E::custom(format!("{v} is negative")))
    }

    fn visit_f64<E: Error>(self, v: f64) -> Result<u64, E> {
        if v.fract() == 0.0 && (0.0..=EXACT_FLOAT_MAX).contains(&v) {
            Ok(v as u64)
        } else {
            Err(E::custom(format!("{v} is not a non-negative integer")))
        }
    }
}

fn narrow<T: TryFrom<u64>, E: Error>(v: u64) -> Result<T, E> {
    T::try_from(v).map_err(|_| E::custom(format!("{v} is out of range")))
}

/// A required (or defaulted) integer field.
pub fn int<'de, D: Deserializer<'de>, T: TryFrom<u64>>(d: D) -> Result<T, D::Error> {
    narrow(d.deserialize_any(Whole)?)
}

/// An optional integer field (`null` or absent is `None`; pair it with
/// `#[serde(default)]`).
pub fn opt<'de, D: Deserializer<'de>, T: TryFrom<u64>>(d: D) -> Result<Option<T>, D::Error> {
    struct Opt;
    impl<'de> Visitor<'de> for Opt {
        type Value = Option<u64>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a non-negative integer or null")
        }
        fn visit_none<E: Error>(self) -> Result<Option<u64>, E> {
            Ok(None)
        }
        fn visit_unit<E: Error>(self) -> Result<Option<u64>, E> {
            Ok(None)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Option<u64>, D::Error> {
            d.deserialize_any(Whole).map(Some)
        }
    }
    d.deserialize_option(Opt)?.map(narrow).transpose()
}

/// A list of integers (each read as [`int`] reads one; pair it with
/// `#[serde(default)]` for an optional list).
pub fn ints<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u64>, D::Error> {
    #[derive(serde::Deserialize)]
    struct One(#[serde(deserialize_with = "int")] u64);
    let list: Vec<One> = serde::Deserialize::deserialize(d)?;
    Ok(list.into_iter().map(|One(v)| v).collect())
}

#[cfg(test)]
mod tests {
    #[derive(Debug, PartialEq, serde::Deserialize)]
    struct T {
        #[serde(deserialize_with = "super::int")]
        a: u32,
        #[serde(default, deserialize_with = "super::opt")]
        b: Option<u64>,
    }

    fn check(json: &str, expect: Option<T>) {
        assert_eq!(serde_json::from_str::<T>(json).ok(), expect, "{json}");
    }

    #[test]
    fn whole_numbers_are_integers_and_nothing_else_is() {
        check(r#"{"a":5}"#, Some(T { a: 5, b: None }));
        check(r#"{"a":5.0,"b":7.0}"#, Some(T { a: 5, b: Some(7) }));
        check(r#"{"a":5,"b":null}"#, Some(T { a: 5, b: None }));
        check(r#"{"a":5,"b":18446744073709551615}"#, Some(T { a: 5, b: Some(u64::MAX) }));
        check(r#"{"a":5.5}"#, None);
        check(r#"{"a":-1}"#, None);
        #[derive(Debug, PartialEq, serde::Deserialize)]
        struct L(#[serde(deserialize_with = "super::ints")] Vec<u64>);
        assert_eq!(serde_json::from_str::<L>("[1, 2.0, 0]").ok(), Some(L(vec![1, 2, 0])));
        assert_eq!(serde_json::from_str::<L>("[1, -2]").ok(), None);
        assert_eq!(serde_json::from_str::<L>("[1.5]").ok(), None);
        check(r#"{"a":-0.0}"#, Some(T { a: 0, b: None }));
        check(r#"{"a":4294967296}"#, None);
        check(r#"{"a":"5"}"#, None);
        check(r#"{"a":5,"b":1e300}"#, None);
        check(r#"{}"#, None);
    }
}
