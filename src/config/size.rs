//! Byte sizes of the configuration: `"0"`, `"4096"`, `"512KiB"`, `"1MiB"`,
//! `"1GiB"` (binary units, as their names say), or a whole number of bytes.

/// The largest size accepted: what one answer may be read ahead of its client.
pub const MAX: u64 = 1 << 30;

/// Parses a size; the error says what was expected.
pub fn parse(value: &toml::Value) -> Result<u64, String> {
    let bytes = match value {
        toml::Value::Integer(n) => {
            u64::try_from(*n).map_err(|_| format!("size {n} is negative"))?
        }
        toml::Value::String(text) => {
            let text = text.trim();
            let split = text
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(text.len());
            let (number, unit) = text.split_at(split);
            let n: u64 = number.parse().map_err(|_| {
                format!(
                    "size '{text}' must be a whole number and a unit, like \"512KiB\" or \"1MiB\""
                )
            })?;
            let unit_bytes: u64 = match unit {
                "" | "B" => 1,
                "KiB" => 1 << 10,
                "MiB" => 1 << 20,
                "GiB" => 1 << 30,
                _ => {
                    return Err(format!(
                        "size '{text}' has an unknown unit '{unit}' (use B, KiB, MiB or GiB)"
                    ));
                }
            };
            n.checked_mul(unit_bytes)
                .ok_or_else(|| format!("size '{text}' is too large"))?
        }
        other => {
            return Err(format!(
                "a size is a string like \"1MiB\", not {}",
                other.type_str()
            ));
        }
    };
    if bytes > MAX {
        return Err(format!("size {bytes} is above the most, 1GiB"));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        let s = |t: &str| parse(&toml::Value::String(t.into()));
        assert_eq!(s("0"), Ok(0));
        assert_eq!(s("4096"), Ok(4096));
        assert_eq!(s("512KiB"), Ok(512 * 1024));
        assert_eq!(s("64MiB"), Ok(64 << 20));
        assert_eq!(parse(&toml::Value::Integer(10)), Ok(10));
        assert!(s("1MB").is_err());
        assert!(s("2GiB").is_err());
        assert!(s("MiB").is_err());
        assert!(s("99999999999999999999KiB").is_err());
        assert!(parse(&toml::Value::Integer(-1)).is_err());
        assert!(parse(&toml::Value::Boolean(true)).is_err());
    }
}
