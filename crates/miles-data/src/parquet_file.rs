//! Parquet prompt files (`--prompt-data train.parquet`, as slime and verl read them): each row
//! becomes the JSON object a JSONL line of the same data would hold, and then goes through the
//! JSONL path's own checks ([`parse_object`]), so keys, labels, metadata and their errors are the
//! same for both formats.
//!
//! Read with the `parquet` crate's record API ([`Row`], [`Field`]), which needs no Arrow arrays.
//! Metadata is the `--metadata-key` column's value when that flag is given, as in JSONL; without
//! it, every other column (those neither prompt nor label, of types the reader converts) goes
//! into the metadata object, as verl's Parquet files carry `data_source`, `extra_info` and the
//! like beside the prompt. Each value becomes the JSON that `json.dumps` of
//! pyarrow's `to_pylist()` would write, where JSON can say it:
//!
//! | Parquet / Arrow                           | JSON                                        |
//! |-------------------------------------------|---------------------------------------------|
//! | null (at any depth)                       | `null`                                      |
//! | boolean                                   | `true` / `false`                            |
//! | (u)int8 … (u)int64                        | number (exact)                              |
//! | float64                                   | number; NaN and ±∞ → `null`                 |
//! | float32, float16                          | number, shortest text of the value (`0.1`)  |
//! | decimal                                   | number read from its exact text (`-12.30`)  |
//! | string, enum, JSON-annotated string       | string                                      |
//! | binary                                    | string if UTF-8, else an error              |
//! | date32                                    | `"2024-02-29"`                              |
//! | time (ms / µs)                            | `"13:04:05.123"`, `"13:04:05.123456"`       |
//! | timestamp (ms / µs, INT96)                | `"2024-02-29T13:04:05.123"`, UTC, no zone   |
//! | timestamp, time (ns)                      | integer (the record API has no ns type)     |
//! | list                                      | array                                       |
//! | struct                                    | object, fields in schema order              |
//! | map                                       | object; a non-string key as its JSON text   |
//!
//! So a `list<struct<role: string, content: string>>` column is a chat prompt exactly as a JSONL
//! list of `{"role", "content"}` objects is, and an int64 label is the label `"5"` as JSONL's
//! `5` is.

use std::cell::Cell;
use std::fs::File;
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::{Arc, Once};

use parquet::basic::{CompressionCodec, ConvertedType, Type as PhysicalType};
use parquet::errors::ParquetError;
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::{Field, Row};
use parquet::schema::types::{ColumnDescriptor, SchemaDescriptor, Type};
use serde_json::{Map, Number, Value};

use crate::dataset::{PROMPT_FORMS, parse_object, quoted_list, row_range};
use crate::{DataError, Dataset, Keys, PromptRow};

/// [`Dataset::load`] for a `.parquet` file: `spec` as given, `path` and `(from, to)` parsed from
/// it.
pub(crate) fn load(
    spec: &str,
    path: &Path,
    from: Option<usize>,
    to: Option<usize>,
    keys: &Keys,
) -> Result<Dataset, DataError> {
    // The parquet crate panics (`unimplemented!`, failed invariants, out-of-range slices) on
    // some corrupt files, in its metadata reader, decoders and record reader; a bad prompt
    // file must be an error the user can act on, not a crash or a panic message. Types it
    // cannot convert are refused before reading (`readable`), so this is a last resort.
    quietly(|| read(spec, path, (from, to), keys)).unwrap_or_else(|panic| {
        let why = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".into());
        Err(error(path, format!("the Parquet reader failed ({why}); the file may be corrupt")))
    })
}

thread_local! {
    /// Set while this thread runs [`quietly`]: its panics print nothing.
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f`, catching a panic without the panic hook's message (on this thread only: the
/// hook stays as it was for every other thread and after `f`).
fn quietly<T>(f: impl FnOnce() -> T) -> std::thread::Result<T> {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(Cell::get) {
                previous(info);
            }
        }));
    });
    let was = QUIET.replace(true);
    let out = catch_unwind(AssertUnwindSafe(f));
    QUIET.set(was);
    out
}

/// [`load`]'s work, which may panic on a corrupt file; `slice` is `(from, to)`.
fn read(
    spec: &str,
    path: &Path,
    slice: (Option<usize>, Option<usize>),
    keys: &Keys,
) -> Result<Dataset, DataError> {
    let io = |source| DataError::Io { path: path.to_path_buf(), source };
    let file = File::open(path).map_err(io)?;
    if file.metadata().map_err(io)?.len() == 0 {
        return Err(error(
            path,
            "the file is empty (0 bytes), not a Parquet file; write it with pyarrow's \
             `pq.write_table` or pandas' `to_parquet`"
                .into(),
        ));
    }
    let reader = SerializedFileReader::new(file).map_err(|e| {
        error(
            path,
            format!(
                "not a readable Parquet file ({e}); a file named *.parquet is read as \
                 Parquet, so a JSONL file needs a .jsonl name"
            ),
        )
    })?;
    let schema = reader.metadata().file_metadata().schema();
    let projection = projection(schema, keys).map_err(|message| error(path, message))?;
    let mut total = 0usize;
    for (g, group) in reader.metadata().row_groups().iter().enumerate() {
        let rows = usize::try_from(group.num_rows()).map_err(|_| {
            error(
                path,
                format!("row group {g} says it has {} rows; the file is corrupt", group.num_rows()),
            )
        })?;
        total = total.saturating_add(rows);
    }
    let wanted = row_range(spec, path, slice, total, " (the Parquet file has no row)")?;
    let rows = read_rows(&reader, &projection, wanted, keys, path)?;
    Ok(Dataset { source: spec.to_string(), rows })
}

fn error(path: &Path, message: String) -> DataError {
    DataError::Parquet { path: path.to_path_buf(), message }
}

/// The file schema cut down to the columns the keys name, in file order; or why it cannot be:
/// a key with no column (worded as the JSONL path's missing key), a prompt column of a type no
/// prompt can be, a column of a type the record reader cannot convert.
fn projection(schema: &Type, keys: &Keys) -> Result<Type, String> {
    let columns = schema.get_fields();
    let wanted: Vec<(&str, &str)> = [
        Some((keys.input_key.as_str(), "--input-key")),
        keys.label_key.as_deref().map(|k| (k, "--label-key")),
        keys.metadata_key.as_deref().map(|k| (k, "--metadata-key")),
    ]
    .into_iter()
    .flatten()
    .collect();
    for &(key, flag) in &wanted {
        let Some(column) = columns.iter().find(|c| c.name() == key) else {
            let have = if columns.is_empty() {
                "this file has no column".to_string()
            } else {
                format!("this file has columns {}", quoted_list(columns.iter().map(|c| c.name())))
            };
            return Err(format!("no column '{key}' (set {flag}; {have})"));
        };
        // A list or struct prompt column is checked row by row, as JSONL's are.
        if key != keys.input_key || !column.is_primitive() {
            continue;
        }
        let (physical, converted) =
            (column.get_physical_type(), column.get_basic_info().converted_type());
        if !is_text(physical, converted) {
            return Err(format!(
                "column '{key}' holds {} values, but the prompt {PROMPT_FORMS} (a string \
                 column, or a list of structs with string fields 'role' and 'content'); check \
                 --input-key",
                type_name(physical, converted),
            ));
        }
    }
    // Without --metadata-key the other columns become the metadata (verl's `data_source`,
    // `extra_info`, …), those the reader can convert.
    let other = |c: &&Arc<Type>| keys.metadata_key.is_none() && all_readable(c);
    let selected: Vec<_> = columns
        .iter()
        .filter(|c| wanted.iter().any(|&(k, _)| k == c.name()) || other(c))
        .cloned()
        .collect();
    let projection =
        Type::group_type_builder(schema.name()).with_fields(selected).build().map_err(|e| {
            format!("cannot select the columns {} ({e})", quoted_list(wanted.iter().map(|w| w.0)))
        })?;
    let leaves = SchemaDescriptor::new(Arc::new(projection.clone()));
    for leaf in leaves.columns() {
        if !readable(leaf) {
            let top = leaf.path().parts().first().map_or("?", String::as_str);
            return Err(format!(
                "column '{top}' holds {} values (at {}), which miles cannot read; leave the \
                 column out of the keys or convert it",
                type_name(leaf.physical_type(), leaf.converted_type()),
                leaf.path().string(),
            ));
        }
    }
    Ok(projection)
}

/// Whether every leaf of a top-level column is of a type [`json`] converts.
fn all_readable(column: &Arc<Type>) -> bool {
    let Ok(alone) = Type::group_type_builder("row").with_fields(vec![column.clone()]).build()
    else {
        return false;
    };
    SchemaDescriptor::new(Arc::new(alone)).columns().iter().all(|leaf| readable(leaf))
}

/// Whether a primitive column reads as text (pyarrow writes strings as annotated BYTE_ARRAY;
/// older writers leave the annotation out).
fn is_text(physical: PhysicalType, converted: ConvertedType) -> bool {
    physical == PhysicalType::BYTE_ARRAY
        && matches!(
            converted,
            ConvertedType::NONE | ConvertedType::UTF8 | ConvertedType::ENUM | ConvertedType::JSON
        )
}

/// Whether the record reader converts this leaf column (its `Field::convert_*` functions call
/// `unimplemented!` on the other combinations).
fn readable(column: &ColumnDescriptor) -> bool {
    use ConvertedType as C;
    let converted = column.converted_type();
    match column.physical_type() {
        PhysicalType::BOOLEAN
        | PhysicalType::INT96
        | PhysicalType::FLOAT
        | PhysicalType::DOUBLE => true,
        PhysicalType::INT32 => matches!(
            converted,
            C::NONE
                | C::INT_8
                | C::INT_16
                | C::INT_32
                | C::UINT_8
                | C::UINT_16
                | C::UINT_32
                | C::DATE
                | C::TIME_MILLIS
                | C::DECIMAL
        ),
        PhysicalType::INT64 => matches!(
            converted,
            C::NONE
                | C::INT_64
                | C::UINT_64
                | C::TIME_MICROS
                | C::TIMESTAMP_MILLIS
                | C::TIMESTAMP_MICROS
                | C::DECIMAL
        ),
        PhysicalType::BYTE_ARRAY => {
            matches!(converted, C::NONE | C::UTF8 | C::ENUM | C::JSON | C::BSON | C::DECIMAL)
        }
        PhysicalType::FIXED_LEN_BYTE_ARRAY => matches!(converted, C::NONE | C::DECIMAL),
    }
}

/// `INT64`, `INT32 (DATE)`: a Parquet type as the Parquet spec names it.
fn type_name(physical: PhysicalType, converted: ConvertedType) -> String {
    match converted {
        ConvertedType::NONE => physical.to_string(),
        c => format!("{physical} ({c})"),
    }
}

/// The rows `wanted` (0-based, within the file) of the projected columns, as [`PromptRow`]s.
/// Row groups wholly outside `wanted` are not read.
fn read_rows(
    reader: &SerializedFileReader<File>,
    projection: &Type,
    wanted: Range<usize>,
    keys: &Keys,
    path: &Path,
) -> Result<Vec<PromptRow>, DataError> {
    let mut rows = Vec::with_capacity(wanted.len());
    let mut first = 0usize; // the file row index of the row group's first row
    for (g, group) in reader.metadata().row_groups().iter().enumerate() {
        // `load` checked that no row group has a negative row count.
        let group_rows = first..first.saturating_add(group.num_rows() as usize);
        first = group_rows.end;
        if group_rows.end <= wanted.start {
            continue;
        }
        if group_rows.start >= wanted.end {
            break;
        }
        for chunk in group.columns() {
            let selected = chunk
                .column_path()
                .parts()
                .first()
                .is_some_and(|top| projection.get_fields().iter().any(|c| c.name() == top));
            let codec = chunk.compression_codec();
            if selected
                && !matches!(
                    codec,
                    CompressionCodec::UNCOMPRESSED
                        | CompressionCodec::SNAPPY
                        | CompressionCodec::ZSTD
                )
            {
                return Err(error(
                    path,
                    format!(
                        "column '{}' is compressed with {codec}, which miles does not read; \
                         write the file with snappy (pyarrow's default), zstd or no compression",
                        chunk.column_path().string()
                    ),
                ));
            }
        }
        let unreadable = |e: ParquetError| error(path, format!("cannot read row group {g}: {e}"));
        let group_reader = reader.get_row_group(g).map_err(unreadable)?;
        let iter = group_reader.get_row_iter(Some(projection.clone())).map_err(unreadable)?;
        for (index, row) in (group_rows.start..).zip(iter) {
            if index >= wanted.end {
                break;
            }
            let row = row.map_err(unreadable)?;
            if index < wanted.start {
                continue;
            }
            let line = index + 1;
            let (prompt, label, metadata) = row_object(&row)
                .and_then(|object| {
                    let (prompt, label, metadata) = parse_object(&object, keys)?;
                    Ok((prompt, label, metadata_of(object, keys, metadata)))
                })
                .map_err(|message| DataError::ParquetRow {
                    path: path.to_path_buf(),
                    row: line,
                    message,
                })?;
            rows.push(PromptRow { prompt, label, metadata, line });
        }
    }
    if rows.len() != wanted.len() {
        return Err(error(
            path,
            format!(
                "rows {}..{} should be there, but only {} could be read; the file is corrupt",
                wanted.start,
                wanted.end,
                rows.len()
            ),
        ));
    }
    Ok(rows)
}

/// A row's metadata: the `--metadata-key` column's value when one is named (as in JSONL),
/// else an object of the columns that are neither prompt nor label (`null` when there are none).
fn metadata_of(mut object: Map<String, Value>, keys: &Keys, keyed: Value) -> Value {
    if keys.metadata_key.is_some() {
        return keyed;
    }
    object.remove(&keys.input_key);
    if let Some(label) = &keys.label_key {
        object.remove(label);
    }
    if object.is_empty() { Value::Null } else { Value::Object(object) }
}

/// A row (or struct) → its JSON object, or what is wrong with one of its values.
fn row_object(row: &Row) -> Result<Map<String, Value>, String> {
    row.get_column_iter()
        .map(|(name, field)| {
            json(field).map(|v| (name.clone(), v)).map_err(|why| format!("column '{name}': {why}"))
        })
        .collect()
}

/// One Parquet value → JSON, as the table in the module docs says.
fn json(field: &Field) -> Result<Value, String> {
    Ok(match field {
        Field::Null => Value::Null,
        Field::Bool(b) => Value::Bool(*b),
        Field::Byte(n) => Value::from(*n),
        Field::Short(n) => Value::from(*n),
        Field::Int(n) => Value::from(*n),
        Field::Long(n) => Value::from(*n),
        Field::UByte(n) => Value::from(*n),
        Field::UShort(n) => Value::from(*n),
        Field::UInt(n) => Value::from(*n),
        Field::ULong(n) => Value::from(*n),
        // The shortest text that reads back as the same f32 (or f16), not the f64 it widens to:
        // a float32 0.1 is 0.1, as pyarrow's writer of it meant, not 0.10000000149011612.
        Field::Float16(x) => shortest_float(x.to_string()),
        Field::Float(x) => shortest_float(x.to_string()),
        Field::Double(x) => Number::from_f64(*x).map_or(Value::Null, Value::Number),
        Field::Decimal(d) => decimal(d.data(), d.scale())?,
        Field::Str(s) => Value::String(s.clone()),
        Field::Bytes(b) => match std::str::from_utf8(b.data()) {
            Ok(text) => Value::String(text.to_string()),
            Err(_) => {
                return Err("binary data that is not UTF-8 text, which JSON cannot hold".into());
            }
        },
        Field::Date(days) => Value::String(date(i64::from(*days))),
        Field::TimeMillis(ms) => Value::String(time(i64::from(*ms), 1_000)),
        Field::TimeMicros(us) => Value::String(time(*us, 1_000_000)),
        Field::TimestampMillis(ms) => Value::String(timestamp(*ms, 1_000)),
        Field::TimestampMicros(us) => Value::String(timestamp(*us, 1_000_000)),
        Field::Group(row) => Value::Object(row_object(row)?),
        Field::ListInternal(list) => {
            Value::Array(list.elements().iter().map(json).collect::<Result<_, _>>()?)
        }
        Field::MapInternal(map) => Value::Object(
            map.entries()
                .iter()
                .map(|(key, value)| {
                    let key = match json(key)? {
                        Value::String(s) => s,
                        other => other.to_string(),
                    };
                    Ok((key, json(value)?))
                })
                .collect::<Result<_, String>>()?,
        ),
    })
}

/// A float's shortest round-trip text (`x.to_string()`) as a JSON number; NaN and ±∞ → null.
fn shortest_float(text: String) -> Value {
    text.parse::<f64>().ok().and_then(Number::from_f64).map_or(Value::Null, Value::Number)
}

/// A decimal (big-endian two's-complement unscaled value, `scale` digits after the point) → the
/// JSON number its exact text reads as, as a JSONL line holding that text would give.
fn decimal(bytes: &[u8], scale: i32) -> Result<Value, String> {
    if bytes.len() > 16 {
        return Err(format!("a decimal of {} bytes, wider than the 16 miles reads", bytes.len()));
    }
    let negative = bytes.first().is_some_and(|b| b & 0x80 != 0);
    let unscaled =
        bytes.iter().fold(if negative { -1i128 } else { 0 }, |v, &b| (v << 8) | i128::from(b));
    let mut digits = unscaled.unsigned_abs().to_string();
    let text = if scale <= 0 {
        if unscaled != 0 {
            digits.extend(std::iter::repeat_n('0', scale.unsigned_abs() as usize));
        }
        digits
    } else {
        let scale = scale as usize;
        if digits.len() <= scale {
            digits.insert_str(0, &"0".repeat(scale + 1 - digits.len()));
        }
        digits.insert(digits.len() - scale, '.');
        digits
    };
    let text = if unscaled < 0 { format!("-{text}") } else { text };
    text.parse::<Number>().map(Value::Number).map_err(|e| format!("decimal {text}: {e}"))
}

/// Days since 1970-01-01 → `YYYY-MM-DD` (proleptic Gregorian; Howard Hinnant's
/// `civil_from_days`).
fn date(days: i64) -> String {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// `ticks` (`per_second` a second) since midnight → `HH:MM:SS.fff` with as many fraction digits
/// as the unit has.
fn time(ticks: i64, per_second: i64) -> String {
    let ticks = ticks.rem_euclid(86_400 * per_second);
    let (seconds, fraction) = (ticks / per_second, ticks % per_second);
    let width = if per_second == 1_000 { 3 } else { 6 };
    format!(
        "{:02}:{:02}:{:02}.{fraction:0width$}",
        seconds / 3_600,
        seconds / 60 % 60,
        seconds % 60
    )
}

/// `ticks` (`per_second` a second) since the Unix epoch → `YYYY-MM-DDTHH:MM:SS.fff` (UTC, no
/// zone suffix: the record API does not say whether the column was zone-adjusted).
fn timestamp(ticks: i64, per_second: i64) -> String {
    let day_ticks = 86_400 * per_second;
    format!(
        "{}T{}",
        date(ticks.div_euclid(day_ticks)),
        time(ticks.rem_euclid(day_ticks), per_second)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::TempFile;
    use miles_core::{Message, Prompt};
    use serde_json::json;

    /// A committed fixture (tests/fixtures/parquet/, written by make_fixtures.py).
    fn fixture(name: &str) -> String {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/parquet");
        dir.join(name).display().to_string()
    }

    fn keys(input: &str, label: Option<&str>, metadata: Option<&str>) -> Keys {
        Keys {
            input_key: input.into(),
            label_key: label.map(Into::into),
            metadata_key: metadata.map(Into::into),
        }
    }

    fn load_err(spec: &str, keys: &Keys) -> String {
        match Dataset::load(spec, keys) {
            Ok(d) => panic!("{spec} loaded {} rows", d.len()),
            Err(e) => e.to_string(),
        }
    }

    /// A footer whose metadata holds a map of 2^31 booleans (a fuzzer's find): parquet 60.1
    /// skipped it one element at a time without reading a byte (seconds of CPU); 60.2 reads
    /// each element's byte and fails at the end of the footer. An error naming the file.
    #[test]
    fn a_footer_with_a_huge_map_of_booleans_is_an_error() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let file = root.join("fuzz/regressions/parquet/map-of-booleans-2e9.parquet");
        let err = load_err(file.to_str().unwrap(), &keys("input", None, None));
        assert!(err.contains("map-of-booleans-2e9.parquet"), "{err}");
        assert!(err.contains("not a readable Parquet file"), "{err}");
    }

    #[test]
    fn parquet_rows_equal_those_of_the_jsonl_twin() {
        for k in [
            keys("question", Some("answer"), Some("meta")),
            keys("question", Some("answer_text"), Some("source")),
            keys("question", Some("score"), Some("score")),
            keys("question", None, None),
        ] {
            let parquet = Dataset::load(&fixture("prompts.parquet"), &k).unwrap();
            let jsonl = Dataset::load(&fixture("prompts.jsonl"), &k).unwrap();
            if k.metadata_key.is_some() {
                assert_eq!(parquet.rows, jsonl.rows, "{k:?}");
            } else {
                // Without a metadata key the other columns are the metadata (JSONL: none).
                let strip = |rows: &[PromptRow]| -> Vec<_> {
                    rows.iter().map(|r| (r.prompt.clone(), r.label.clone(), r.line)).collect()
                };
                assert_eq!(strip(&parquet.rows), strip(&jsonl.rows), "{k:?}");
            }
            assert_eq!(parquet.source, fixture("prompts.parquet"));
        }
        let d = Dataset::load(&fixture("prompts.parquet"), &keys("question", Some("answer"), None))
            .unwrap();
        let Value::Object(first) = &d.rows[0].metadata else { panic!("{:?}", d.rows[0]) };
        let mut names: Vec<&str> = first.keys().map(String::as_str).collect();
        names.sort();
        let jsonl_line: Value = serde_json::from_str(
            std::fs::read_to_string(fixture("prompts.jsonl")).unwrap().lines().next().unwrap(),
        )
        .unwrap();
        let mut want: Vec<&str> =
            jsonl_line.as_object().unwrap().keys().map(String::as_str).collect();
        want.retain(|k| *k != "question" && *k != "answer");
        want.sort();
        assert_eq!(names, want, "every other column, and only those");
        assert_eq!(first["meta"], jsonl_line["meta"]);
        let d = Dataset::load(
            &fixture("prompts.parquet"),
            &keys("question", Some("answer"), Some("meta")),
        )
        .unwrap();
        assert_eq!(d.rows[4].prompt, Prompt::Text("Ünïcode — ok?".into()));
        let labels: Vec<_> = d.rows.iter().map(|r| r.label.as_deref().unwrap()).collect();
        assert_eq!(labels, ["5", "7", "1", "2", "-4"]);
        let metadata: Vec<_> = d.rows.iter().map(|r| r.metadata.clone()).collect();
        assert_eq!(
            metadata,
            [
                json!({"id": "a", "tags": ["math"]}),
                json!({"id": "b", "tags": []}),
                Value::Null,
                json!({"id": "d", "tags": ["math", "easy"]}),
                json!({"id": null, "tags": null}),
            ]
        );
        let lines: Vec<_> = d.rows.iter().map(|r| r.line).collect();
        assert_eq!(lines, [1, 2, 3, 4, 5], "line is the 1-based row number");
        let d = Dataset::load(&fixture("prompts.parquet"), &keys("question", Some("score"), None))
            .unwrap();
        let labels: Vec<_> = d.rows.iter().map(|r| r.label.as_deref().unwrap()).collect();
        assert_eq!(labels, ["0.5", "1.25", "-2.0", "2.5", "0.001"]);
    }

    #[test]
    fn slices_select_the_rows_jsonl_slices_do_across_row_groups() {
        // prompts.parquet holds its 5 rows in two row groups, 0..3 and 3..5.
        let k = keys("question", Some("answer"), Some("meta"));
        for slice in ["@[1:4]", "@[3:]", "@[:2]", "@[2:3]", "@[4:100]", "@[:]", "@[0:5]"] {
            let spec = format!("{}{slice}", fixture("prompts.parquet"));
            let parquet = Dataset::load(&spec, &k).unwrap();
            let jsonl = Dataset::load(&format!("{}{slice}", fixture("prompts.jsonl")), &k).unwrap();
            assert_eq!(parquet.source, spec);
            assert_eq!(parquet.rows, jsonl.rows, "{slice}");
        }
        let lines = |slice: &str| -> Vec<usize> {
            let d = Dataset::load(&format!("{}{slice}", fixture("prompts.parquet")), &k).unwrap();
            d.rows.iter().map(|r| r.line).collect()
        };
        assert_eq!(lines("@[1:4]"), [2, 3, 4]);
        assert_eq!(lines("@[4:100]"), [5], "the end is clamped to the row count");
        for slice in ["@[5:]", "@[2:2]", "@[3:1]"] {
            let spec = format!("{}{slice}", fixture("prompts.parquet"));
            let e = load_err(&spec, &k);
            assert!(
                e.starts_with(&spec) && e.contains("selects no row") && e.contains("5 rows"),
                "{e}"
            );
        }
    }

    #[test]
    fn rows_outside_the_slice_are_not_checked() {
        // Row 2 of `text` is null, which no prompt can be.
        let spec = format!("{}@[:1]", fixture("wrong_type.parquet"));
        let d = Dataset::load(&spec, &keys("text", Some("answer"), None)).unwrap();
        assert_eq!(d.rows[0].prompt, Prompt::Text("fine".into()));
        let e = load_err(&fixture("wrong_type.parquet"), &keys("text", None, None));
        assert!(
            e.starts_with(&format!(
                "{}: row 2 (counted from 1): prompt 'text' is null",
                fixture("wrong_type.parquet")
            )),
            "{e}"
        );
        assert!(e.contains("chat messages"), "{e}");
    }

    #[test]
    fn the_extension_is_matched_in_any_case() {
        let bytes = std::fs::read(fixture("prompts.parquet")).unwrap();
        let f = TempFile::new("PROMPTS.Parquet", &bytes);
        let d = Dataset::load(&f.spec(), &keys("question", None, None)).unwrap();
        assert_eq!(d.len(), 5);
    }

    #[test]
    fn a_chat_message_column_is_a_chat_prompt_as_in_jsonl() {
        // chat.parquet is zstd-compressed.
        let k = keys("messages", Some("answer"), None);
        let d = Dataset::load(&fixture("chat.parquet"), &k).unwrap();
        assert_eq!(d.rows, Dataset::load(&fixture("chat.jsonl"), &k).unwrap().rows);
        let message =
            |role: &str, content: &str| Message { role: role.into(), content: content.into() };
        assert_eq!(
            d.rows[0].prompt,
            Prompt::Messages(vec![message("system", "Be brief."), message("user", "2 + 2?")])
        );
        assert_eq!(
            d.rows[2].prompt,
            Prompt::Messages(vec![
                message("user", "Hi"),
                message("assistant", "Hello!"),
                message("user", "Bye"),
            ])
        );
        assert_eq!(d.rows[1].label.as_deref(), Some("red"));
        // The same column as metadata is the JSON list of objects.
        let d = Dataset::load(&fixture("chat.parquet"), &keys("answer", None, Some("messages")))
            .unwrap();
        assert_eq!(d.rows[1].metadata, json!([{"role": "user", "content": "Name a colour."}]));
    }

    #[test]
    fn a_missing_column_says_which_flag_to_set_and_lists_the_columns() {
        let spec = fixture("prompts.parquet");
        let columns = "this file has columns 'question', 'answer', 'answer_text', 'score', \
                       'meta', 'source')";
        for (k, flag, key) in [
            (keys("input", None, None), "--input-key", "input"),
            (keys("question", Some("label"), None), "--label-key", "label"),
            (keys("question", None, Some("metadata")), "--metadata-key", "metadata"),
        ] {
            let e = load_err(&spec, &k);
            assert_eq!(e, format!("{spec}: no column '{key}' (set {flag}; {columns}"));
        }
    }

    #[test]
    fn a_prompt_column_of_the_wrong_type_is_refused_before_reading() {
        let spec = fixture("wrong_type.parquet");
        let e = load_err(&spec, &keys("prompt", Some("answer"), None));
        assert!(e.starts_with(&format!("{spec}: column 'prompt' holds INT64 values")), "{e}");
        assert!(e.contains("chat messages") && e.contains("check --input-key"), "{e}");
        // A struct prompt is refused row by row, in the JSONL path's words.
        let spec = fixture("prompts.parquet");
        let e = load_err(&spec, &keys("meta", None, None));
        assert!(
            e.starts_with(&format!("{spec}: row 1 (counted from 1): prompt 'meta' is an object")),
            "{e}"
        );
    }

    #[test]
    fn a_label_of_the_wrong_kind_names_the_row() {
        let spec = fixture("prompts.parquet");
        let e = load_err(&spec, &keys("question", Some("meta"), None));
        assert!(
            e.starts_with(&format!(
                "{spec}: row 1 (counted from 1): label 'meta' must be a string"
            )),
            "{e}"
        );
        assert!(e.contains("found an object") && e.contains("--label-key"), "{e}");
    }

    #[test]
    fn a_jsonl_file_named_parquet_is_not_a_parquet_file() {
        let jsonl = std::fs::read(fixture("prompts.jsonl")).unwrap();
        let f = TempFile::new("train.parquet", &jsonl);
        let e = load_err(&f.spec(), &Keys::default());
        assert!(e.starts_with(&format!("{}: not a readable Parquet file (", f.spec())), "{e}");
        assert!(e.contains("a JSONL file needs a .jsonl name"), "{e}");
        let f = TempFile::new("tiny.parquet", b"PAR1");
        let e = load_err(&f.spec(), &Keys::default());
        assert!(e.starts_with(&format!("{}: not a readable Parquet file (", f.spec())), "{e}");
    }

    #[test]
    fn an_empty_file_and_a_file_without_rows_are_errors() {
        let f = TempFile::new("zero.parquet", b"");
        let e = load_err(&f.spec(), &Keys::default());
        assert!(e.starts_with(&format!("{}: the file is empty (0 bytes)", f.spec())), "{e}");
        let spec = fixture("empty.parquet");
        let e = load_err(&spec, &keys("question", Some("answer"), None));
        assert_eq!(e, format!("{spec}: no prompt rows (the Parquet file has no row)"));
        let e = load_err(&format!("{spec}@[0:1]"), &keys("question", None, None));
        assert!(e.contains("selects no row") && e.contains("0 rows"), "{e}");
    }

    #[test]
    fn a_missing_file_names_the_path() {
        let path = std::env::temp_dir().join("miles-data-no-such-file.parquet");
        let e = load_err(&path.display().to_string(), &Keys::default());
        assert!(e.starts_with(&format!("cannot read {}:", path.display())), "{e}");
    }

    #[test]
    fn a_codec_not_built_in_is_named() {
        let spec = fixture("gzip.parquet");
        let e = load_err(&spec, &Keys::default());
        assert!(e.starts_with(&format!("{spec}: column 'input' is compressed with GZIP")), "{e}");
        assert!(e.contains("snappy") && e.contains("zstd"), "{e}");
    }

    #[test]
    fn corrupt_data_is_an_error_never_a_panic() {
        let spec = |f: &TempFile| format!("{}: ", f.spec());
        let k = keys("question", Some("answer"), Some("meta"));
        let original = std::fs::read(fixture("prompts.parquet")).unwrap();
        // The footer: the metadata, its length, "PAR1". Before it (after the leading "PAR1"),
        // the pages.
        let n = original.len();
        let metadata_len = u32::from_le_bytes(original[n - 8..n - 4].try_into().unwrap());
        let pages = 4..n - 8 - metadata_len as usize;
        // Pages overwritten: the metadata reads, the rows do not.
        let mut bytes = original.clone();
        bytes[pages.clone()].fill(0xA5);
        let f = TempFile::new("corrupt.parquet", &bytes);
        let e = load_err(&f.spec(), &k);
        assert!(e.starts_with(&format!("{}cannot read row group 0: ", spec(&f))), "{e}");
        // One byte changed, at each place in turn: a row that still reads, or an error naming
        // the file. Some of these (5 with parquet 60.1) make the record reader panic, which
        // `load` turns into an error.
        for i in pages {
            let mut bytes = original.clone();
            bytes[i] = bytes[i].wrapping_add(41);
            let f = TempFile::new("corrupt.parquet", &bytes);
            if let Err(e) = Dataset::load(&f.spec(), &k) {
                assert!(e.to_string().starts_with(&spec(&f)), "byte {i}: {e}");
            }
        }
    }

    #[test]
    fn each_arrow_type_maps_to_its_natural_json() {
        let expected = [
            ("bool", json!(true)),
            ("int8", json!(-8)),
            ("uint64", json!(u64::MAX)),
            ("float32", json!(0.1)),
            ("float64_nan", Value::Null),
            ("decimal", json!(-12.3)),
            ("string", json!("text")),
            ("binary", json!("bytes")),
            ("date", json!("2024-02-29")),
            ("timestamp_ms", json!("2024-02-29T13:04:05.123")),
            ("timestamp_us", json!("1969-12-31T23:59:59.999999")),
            ("list_of_lists", json!([[1, 2], [], null])),
            ("map", json!({"k": 1, "j": null})),
            ("struct", json!({"a": 1, "b": {"c": "x"}})),
        ];
        for (column, value) in expected {
            let d = Dataset::load(&fixture("types.parquet"), &keys("prompt", None, Some(column)))
                .unwrap_or_else(|e| panic!("{column}: {e}"));
            assert_eq!(d.rows[0].metadata, value, "{column}");
            assert_eq!(d.rows[1].metadata, Value::Null, "{column}: null");
        }
    }

    #[test]
    fn a_column_type_the_reader_cannot_convert_is_refused() {
        let schema = parquet::schema::parser::parse_message_type(
            "message schema { required binary input (UTF8); \
             optional fixed_len_byte_array(12) span (INTERVAL); }",
        )
        .unwrap();
        let e = projection(&schema, &keys("input", None, Some("span"))).unwrap_err();
        assert!(e.starts_with("column 'span' holds FIXED_LEN_BYTE_ARRAY (INTERVAL) values"), "{e}");
        assert!(projection(&schema, &keys("input", None, None)).is_ok());
    }

    #[test]
    fn dates_times_and_decimals_print_exactly() {
        assert_eq!(date(0), "1970-01-01");
        assert_eq!(date(-1), "1969-12-31");
        assert_eq!(date(19_782), "2024-02-29");
        assert_eq!(date(-719_528), "0000-01-01");
        assert_eq!(time(45_296_789, 1_000), "12:34:56.789");
        assert_eq!(time(-1, 1_000_000), "23:59:59.999999");
        assert_eq!(timestamp(-1, 1_000), "1969-12-31T23:59:59.999");
        assert_eq!(timestamp(1_709_211_845_123, 1_000), "2024-02-29T13:04:05.123");
        let d = |v: i64, scale| decimal(&v.to_be_bytes(), scale).unwrap();
        assert_eq!(d(-1230, 2), json!(-12.3));
        assert_eq!(d(5, 3), json!(0.005));
        assert_eq!(d(-5, 3), json!(-0.005));
        assert_eq!(d(42, 0), json!(42));
        assert_eq!(d(42, -2), json!(4200));
        assert_eq!(d(0, 2), json!(0.0));
        assert_eq!(decimal(&[0xFF, 0x85], 0).unwrap(), json!(-123));
        assert!(decimal(&[1; 17], 0).unwrap_err().contains("17 bytes"));
        assert_eq!(shortest_float(f32::NAN.to_string()), Value::Null);
        assert_eq!(shortest_float(0.1f32.to_string()), json!(0.1));
    }
}
