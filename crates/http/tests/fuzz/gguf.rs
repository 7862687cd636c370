//! Mutated and random GGUF files through `ServedModel::load` (weights, tokenizer and template
//! from the metadata, engine start): each loads or is an error; never a panic, an allocation
//! the file cannot justify (see `ALLOCATION_LIMIT`) or a hang.

use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use temper_http::{ModelSpec, ServedModel};

use crate::{Campaign, Rng};

/// Loading the tiny model takes well under a second; this is a hang.
const LOAD_TIMEOUT: Duration = Duration::from_secs(30);

/// A place in the valid file worth overwriting with boundary values.
#[derive(Debug, Clone, Copy)]
struct Field {
    offset: usize,
    width: usize,
    kind: FieldKind,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum FieldKind {
    /// Magic and version.
    Header,
    /// A tensor, metadata or array element count, a string length, a dimension count or size.
    Count,
    /// A metadata value type, an array's element type or a tensor's ggml type.
    Type,
    /// A metadata integer value (the model's dimensions, token ids, …).
    Value,
    /// A tensor's data offset.
    Offset,
}

#[test]
fn gguf_files_load_or_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let valid_path = dir.path().join("valid.gguf");
    temper_model::tiny::write_tiny_gguf(&valid_path, 7).unwrap();
    let valid = std::fs::read(&valid_path).unwrap();
    let layout = Layout::walk(&valid);
    assert!(
        load(&valid_path).unwrap().is_ok(),
        "the unmutated file loads"
    );

    let path = dir.path().join("case.gguf");
    let mut rejected = 0;
    let mut campaign = Campaign::new("gguf_files_load_or_fail_cleanly", 0x6767_7566);
    while let Some(seed) = campaign.next() {
        let bytes = mutate(&valid, &layout, &mut Rng::new(seed));
        std::fs::write(&path, &bytes).unwrap();
        match load(&path) {
            Ok(Ok(())) => {}
            Ok(Err(_)) => rejected += 1,
            Err(what) => campaign.fail(seed, &what),
        }
    }
    println!("gguf: {rejected} files rejected with an error");
}

/// `Ok(Err(message))` is a load error; `Err` a panic or a hang.
fn load(path: &Path) -> Result<Result<(), String>, String> {
    let mut spec = ModelSpec::new("fuzz", path);
    spec.engine.kv_cache_bytes = 1 << 20;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
            ServedModel::load(&spec)
                .map(drop)
                .map_err(|e| e.to_string())
        }));
        let _ = tx.send(outcome.map_err(|payload| panic_message(&*payload)));
    });
    match rx.recv_timeout(LOAD_TIMEOUT) {
        Ok(Ok(loaded)) => Ok(loaded),
        Ok(Err(panic)) => Err(format!("loading panicked: {panic}")),
        Err(_) => Err(format!("loading took over {LOAD_TIMEOUT:?}")),
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(not a string)".to_owned())
}

/// The fields of a valid GGUF (v2/v3: 64-bit lengths) and where its tensor data starts.
struct Layout {
    fields: Vec<Field>,
    data_start: usize,
}

impl Layout {
    fn walk(bytes: &[u8]) -> Layout {
        let mut w = Walker {
            bytes,
            pos: 0,
            fields: Vec::new(),
        };
        w.field(4, FieldKind::Header);
        w.field(4, FieldKind::Header);
        let tensors = w.field(8, FieldKind::Count);
        let kvs = w.field(8, FieldKind::Count);
        for _ in 0..kvs {
            w.string();
            let value_type = w.field(4, FieldKind::Type);
            w.value(value_type);
        }
        for _ in 0..tensors {
            w.string();
            let dims = w.field(4, FieldKind::Count);
            for _ in 0..dims {
                w.field(8, FieldKind::Count);
            }
            w.field(4, FieldKind::Type);
            w.field(8, FieldKind::Offset);
        }
        Layout {
            data_start: w.pos.next_multiple_of(32),
            fields: w.fields,
        }
    }
}

struct Walker<'a> {
    bytes: &'a [u8],
    pos: usize,
    fields: Vec<Field>,
}

impl Walker<'_> {
    /// Records the little-endian field at the cursor and returns its value.
    fn field(&mut self, width: usize, kind: FieldKind) -> u64 {
        let mut le = [0u8; 8];
        le[..width].copy_from_slice(&self.bytes[self.pos..self.pos + width]);
        self.fields.push(Field {
            offset: self.pos,
            width,
            kind,
        });
        self.pos += width;
        u64::from_le_bytes(le)
    }

    fn string(&mut self) {
        self.pos += self.field(8, FieldKind::Count) as usize;
    }

    /// GGUF value types: 0..=5 and 10, 11 integers, 6 f32, 7 bool, 8 string, 9 array, 12 f64.
    fn value(&mut self, value_type: u64) {
        match value_type {
            0 | 1 | 7 => self.pos += 1,
            2 | 3 => {
                self.field(2, FieldKind::Value);
            }
            4 | 5 => {
                self.field(4, FieldKind::Value);
            }
            10 | 11 => {
                self.field(8, FieldKind::Value);
            }
            6 => self.pos += 4,
            12 => self.pos += 8,
            8 => self.string(),
            9 => {
                let element_type = self.field(4, FieldKind::Type);
                let len = self.field(8, FieldKind::Count);
                for _ in 0..len {
                    self.value(element_type);
                }
            }
            other => panic!("the tiny model has no value type {other}"),
        }
    }
}

/// One to three mutations of `valid`, or (1 in 20) random bytes after a GGUF header.
fn mutate(valid: &[u8], layout: &Layout, rng: &mut Rng) -> Vec<u8> {
    if rng.one_in(20) {
        let mut bytes = valid[..8].to_vec();
        let len = rng.below(4096);
        bytes.extend((0..len).map(|_| rng.next_u64() as u8));
        return bytes;
    }
    let mut bytes = valid.to_vec();
    for _ in 0..1 + rng.below(3) {
        // Most structure is before the tensor data: mutations land there 3 times in 4.
        let region = if rng.below(4) < 3 {
            layout.data_start
        } else {
            bytes.len()
        };
        let at = rng.below(region.min(bytes.len()).max(1));
        match rng.below(8) {
            0..=2 => {
                let field = *rng.pick(&layout.fields);
                if field.offset + field.width <= bytes.len() {
                    let value = boundary_value(field, bytes.len(), rng);
                    bytes[field.offset..field.offset + field.width]
                        .copy_from_slice(&value.to_le_bytes()[..field.width]);
                }
            }
            3 => {
                if let Some(b) = bytes.get_mut(at) {
                    *b ^= 1 << rng.below(8);
                }
            }
            4 => {
                if let Some(b) = bytes.get_mut(at) {
                    *b = rng.next_u64() as u8;
                }
            }
            5 => bytes.truncate(at),
            6 => {
                let end = (at + 1 + rng.below(64)).min(bytes.len());
                bytes.drain(at..end);
            }
            _ => {
                let junk: Vec<u8> = (0..1 + rng.below(16))
                    .map(|_| rng.next_u64() as u8)
                    .collect();
                bytes.splice(at..at, junk);
            }
        }
    }
    bytes
}

fn boundary_value(field: Field, file_len: usize, rng: &mut Rng) -> u64 {
    let bits = 8 * field.width as u32;
    let max = u64::MAX >> (64 - bits);
    match field.kind {
        FieldKind::Type if rng.below(4) > 0 => rng.below(48) as u64,
        _ => match rng.below(12) {
            0 => 0,
            1 => 1,
            2 => 2 + rng.below(64) as u64,
            3 => max,
            4 => max >> 1,
            5 => (max >> 1) + 1,
            6 => 1 << (bits - 4),
            7 => file_len as u64 & max,
            8 => (file_len as u64 + 1) & max,
            9 => 1 << rng.below(bits as usize),
            10 => (1u64 << 32) & max,
            _ => rng.next_u64() & max,
        },
    }
}
