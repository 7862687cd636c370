//! The protobuf messages of the Tinker SDK's wire (`tinker_public.proto`) that temper reads or
//! writes: the `forward_backward` request (the SDK posts it as protobuf), and the two results
//! the SDK takes only as protobuf (`ForwardBackwardOutput`, `SampleResponse`). A hand-written
//! reader and writer of the protobuf wire format for exactly these fields; unknown fields are
//! skipped, as protobuf readers do.

use std::collections::BTreeMap;

/// Why a body is not the message it should be.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("the protobuf body is malformed: {0}")]
pub struct DecodeError(String);

fn bad<T>(what: impl Into<String>) -> Result<T, DecodeError> {
    Err(DecodeError(what.into()))
}

/// One field of a message as read.
enum Value<'a> {
    Varint(u64),
    Fixed64(u64),
    Bytes(&'a [u8]),
    /// A 32-bit field (no field temper reads has one).
    Fixed32,
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn varint(&mut self) -> Result<u64, DecodeError> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let Some((&b, rest)) = self.buf.split_first() else {
                return bad("a varint runs past the end");
            };
            self.buf = rest;
            value |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(value);
            }
        }
        bad("a varint is longer than 10 bytes")
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if n > self.buf.len() {
            return bad("a field runs past the end");
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    fn next(&mut self) -> Result<Option<(u32, Value<'a>)>, DecodeError> {
        if self.buf.is_empty() {
            return Ok(None);
        }
        let key = self.varint()?;
        let field = u32::try_from(key >> 3).or(bad("a field number is out of range"))?;
        let value = match key & 7 {
            0 => Value::Varint(self.varint()?),
            1 => Value::Fixed64(u64::from_le_bytes(self.take(8)?.try_into().unwrap())),
            2 => {
                let n = usize::try_from(self.varint()?).or(bad("a length is out of range"))?;
                Value::Bytes(self.take(n)?)
            }
            5 => {
                self.take(4)?;
                Value::Fixed32
            }
            w => return bad(format!("unsupported wire type {w}")),
        };
        Ok(Some((field, value)))
    }
}

/// Calls `f` with each field of `buf`.
fn fields<'a>(
    buf: &'a [u8],
    mut f: impl FnMut(u32, Value<'a>) -> Result<(), DecodeError>,
) -> Result<(), DecodeError> {
    let mut r = Reader { buf };
    while let Some((field, value)) = r.next()? {
        f(field, value)?;
    }
    Ok(())
}

fn bytes<'a>(v: Value<'a>, name: &str) -> Result<&'a [u8], DecodeError> {
    match v {
        Value::Bytes(b) => Ok(b),
        _ => bad(format!("`{name}` is not length-delimited")),
    }
}

fn string(v: Value<'_>, name: &str) -> Result<String, DecodeError> {
    String::from_utf8(bytes(v, name)?.to_vec()).or(bad(format!("`{name}` is not UTF-8")))
}

fn varint(v: Value<'_>, name: &str) -> Result<u64, DecodeError> {
    match v {
        Value::Varint(x) => Ok(x),
        _ => bad(format!("`{name}` is not a varint")),
    }
}

fn double(v: Value<'_>, name: &str) -> Result<f64, DecodeError> {
    match v {
        Value::Fixed64(x) => Ok(f64::from_bits(x)),
        _ => bad(format!("`{name}` is not a double")),
    }
}

/// A `Tensor` as sent: dense values of `dtype` (1 float32, 2 int64), or a sparse CSR layout.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tensor {
    pub dtype: u64,
    pub shape: Vec<i64>,
    pub dense: Vec<u8>,
    pub sparse: bool,
}

pub const DTYPE_FLOAT32: u64 = 1;
pub const DTYPE_INT64: u64 = 2;

impl Tensor {
    fn decode(buf: &[u8]) -> Result<Tensor, DecodeError> {
        let mut t = Tensor::default();
        fields(buf, |field, v| {
            match field {
                1 => t.dense = bytes(v, "Tensor.dense")?.to_vec(),
                2 => t.sparse = true,
                3 => t.dtype = varint(v, "Tensor.dtype")?,
                4 => match v {
                    // Packed (proto3's default) or one varint per element.
                    Value::Bytes(b) => {
                        let mut r = Reader { buf: b };
                        while !r.buf.is_empty() {
                            t.shape.push(r.varint()? as i64);
                        }
                    }
                    v => t.shape.push(varint(v, "Tensor.shape")? as i64),
                },
                _ => {}
            }
            Ok(())
        })?;
        Ok(t)
    }

    /// The values as f64, whichever the dtype; `None` for a dtype or layout temper does not
    /// read (sparse tensors, unknown dtypes).
    pub fn values(&self) -> Option<Vec<f64>> {
        if self.sparse {
            return None;
        }
        match self.dtype {
            DTYPE_FLOAT32 if self.dense.len().is_multiple_of(4) => Some(
                self.dense
                    .chunks_exact(4)
                    .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())))
                    .collect(),
            ),
            DTYPE_INT64 if self.dense.len().is_multiple_of(8) => Some(
                self.dense
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
            ),
            _ => None,
        }
    }
}

/// One chunk of a datum's model input.
#[derive(Debug, Clone, PartialEq)]
pub enum Chunk {
    Tokens(Vec<u32>),
    /// An image or audio chunk: temper's models take text only.
    Other(&'static str),
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Datum {
    pub chunks: Vec<Chunk>,
    pub loss_fn_inputs: BTreeMap<String, Tensor>,
}

impl Datum {
    fn decode(buf: &[u8]) -> Result<Datum, DecodeError> {
        let mut d = Datum::default();
        fields(buf, |field, v| {
            match field {
                1 => d.chunks.push(decode_chunk(bytes(v, "Datum.model_input")?)?),
                2 => {
                    let (mut key, mut value) = (String::new(), Tensor::default());
                    fields(bytes(v, "Datum.loss_fn_inputs")?, |f, v| {
                        match f {
                            1 => key = string(v, "loss_fn_inputs key")?,
                            2 => value = Tensor::decode(bytes(v, "loss_fn_inputs value")?)?,
                            _ => {}
                        }
                        Ok(())
                    })?;
                    d.loss_fn_inputs.insert(key, value);
                }
                _ => {}
            }
            Ok(())
        })?;
        Ok(d)
    }
}

fn decode_chunk(buf: &[u8]) -> Result<Chunk, DecodeError> {
    let mut chunk = Chunk::Tokens(Vec::new());
    fields(buf, |field, v| {
        chunk = match field {
            1 => {
                let mut tokens = Vec::new();
                fields(bytes(v, "Chunk.encoded_text")?, |f, v| {
                    if f == 1 {
                        let b = bytes(v, "EncodedTextChunk.tokens")?;
                        if b.len() % 4 != 0 {
                            return bad("EncodedTextChunk.tokens is not int32 values");
                        }
                        tokens.extend(
                            b.chunks_exact(4)
                                .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32),
                        );
                    }
                    Ok(())
                })?;
                Chunk::Tokens(tokens)
            }
            2 => Chunk::Other("image"),
            3 => Chunk::Other("dmel"),
            _ => return Ok(()),
        };
        Ok(())
    })?;
    Ok(chunk)
}

/// A number or a string of `loss_fn_config`.
#[derive(Debug, Clone, PartialEq)]
pub enum ConfigValue {
    Number(f64),
    Text(String),
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ForwardBackwardRequest {
    pub model_id: String,
    pub seq_id: i64,
    pub data: Vec<Datum>,
    pub loss_fn: String,
    pub loss_fn_config: BTreeMap<String, ConfigValue>,
    pub forward_only: bool,
}

impl ForwardBackwardRequest {
    pub fn decode(buf: &[u8]) -> Result<ForwardBackwardRequest, DecodeError> {
        let mut r = ForwardBackwardRequest::default();
        let mut v2 = BTreeMap::new();
        fields(buf, |field, v| {
            match field {
                1 => r.model_id = string(v, "model_id")?,
                2 => r.seq_id = varint(v, "seq_id")? as i32 as i64,
                3 => r.data.push(Datum::decode(bytes(v, "data")?)?),
                4 => r.loss_fn = string(v, "loss_fn")?,
                5 => {
                    let (mut key, mut value) = (String::new(), 0.0);
                    fields(bytes(v, "loss_fn_config")?, |f, v| {
                        match f {
                            1 => key = string(v, "loss_fn_config key")?,
                            2 => value = double(v, "loss_fn_config value")?,
                            _ => {}
                        }
                        Ok(())
                    })?;
                    r.loss_fn_config.insert(key, ConfigValue::Number(value));
                }
                6 => r.forward_only = varint(v, "forward_only")? != 0,
                7 => {
                    let (mut key, mut value) = (String::new(), ConfigValue::Number(0.0));
                    fields(bytes(v, "loss_fn_config_v2")?, |f, v| {
                        match f {
                            1 => key = string(v, "loss_fn_config_v2 key")?,
                            2 => fields(bytes(v, "loss_fn_config_v2 value")?, |f, v| {
                                match f {
                                    1 => value = ConfigValue::Number(double(v, "number")?),
                                    2 => value = ConfigValue::Text(string(v, "text")?),
                                    _ => {}
                                }
                                Ok(())
                            })?,
                            _ => {}
                        }
                        Ok(())
                    })?;
                    v2.insert(key, value);
                }
                _ => {}
            }
            Ok(())
        })?;
        // The SDK writes numbers to both maps and strings only to v2, which wins.
        r.loss_fn_config.extend(v2);
        Ok(r)
    }
}

impl ForwardBackwardRequest {
    /// The message as the SDK writes it (dense tensors, numbers in `loss_fn_config`): for
    /// clients other than the SDK, and tests.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.bytes(1, self.model_id.as_bytes());
        w.uint(2, self.seq_id as u64);
        for d in &self.data {
            let mut datum = Writer::default();
            for c in &d.chunks {
                if let Chunk::Tokens(t) = c {
                    let mut text = Writer::default();
                    let bytes: Vec<u8> = t.iter().flat_map(|x| x.to_le_bytes()).collect();
                    text.bytes(1, &bytes);
                    let mut chunk = Writer::default();
                    chunk.message(1, text);
                    datum.message(1, chunk);
                }
            }
            for (name, t) in &d.loss_fn_inputs {
                let mut tensor = Writer::default();
                tensor.bytes(1, &t.dense);
                tensor.uint(3, t.dtype);
                let shape: Vec<u8> = t
                    .shape
                    .iter()
                    .fold(Writer::default(), |mut s, &x| {
                        s.varint(x as u64);
                        s
                    })
                    .buf;
                tensor.bytes(4, &shape);
                let mut entry = Writer::default();
                entry.bytes(1, name.as_bytes());
                entry.message(2, tensor);
                datum.message(2, entry);
            }
            w.message(3, datum);
        }
        w.bytes(4, self.loss_fn.as_bytes());
        for (k, v) in &self.loss_fn_config {
            if let ConfigValue::Number(x) = v {
                let mut entry = Writer::default();
                entry.bytes(1, k.as_bytes());
                entry.double(2, *x);
                w.message(5, entry);
            }
        }
        w.uint(6, u64::from(self.forward_only));
        w.buf
    }
}

impl Tensor {
    /// A dense float32 tensor of shape `[values.len()]`.
    pub fn f32(values: &[f32]) -> Tensor {
        Tensor {
            dtype: DTYPE_FLOAT32,
            shape: vec![values.len() as i64],
            dense: f32_bytes(values),
            sparse: false,
        }
    }

    /// A dense int64 tensor of shape `[values.len()]`.
    pub fn i64(values: &[i64]) -> Tensor {
        Tensor {
            dtype: DTYPE_INT64,
            shape: vec![values.len() as i64],
            dense: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            sparse: false,
        }
    }
}

/// A protobuf message being written.
#[derive(Default)]
struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    fn varint(&mut self, mut x: u64) {
        while x >= 0x80 {
            self.buf.push((x as u8) | 0x80);
            x >>= 7;
        }
        self.buf.push(x as u8);
    }

    fn key(&mut self, field: u32, wire: u8) {
        self.varint(u64::from(field) << 3 | u64::from(wire));
    }

    fn uint(&mut self, field: u32, x: u64) {
        self.key(field, 0);
        self.varint(x);
    }

    fn double(&mut self, field: u32, x: f64) {
        self.key(field, 1);
        self.buf.extend(x.to_le_bytes());
    }

    fn bytes(&mut self, field: u32, b: &[u8]) {
        self.key(field, 2);
        self.varint(b.len() as u64);
        self.buf.extend(b);
    }

    fn message(&mut self, field: u32, m: Writer) {
        self.bytes(field, &m.buf);
    }
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// `ForwardBackwardOutput` with one `ArrayRecord` holding each named float32 field per datum
/// (e.g. `logprobs`), and the metrics.
pub fn forward_backward_output(
    fields: &[(&str, Vec<Vec<f32>>)],
    num_datums: usize,
    metrics: &[(&str, f64)],
) -> Vec<u8> {
    let mut out = Writer::default();
    out.bytes(1, b"ArrayRecord");
    let mut record = Writer::default();
    record.bytes(1, b"ArrayRecord");
    for (name, per_datum) in fields {
        let mut tensor = Writer::default();
        let mut data = Vec::new();
        let mut offsets: Vec<u8> = 0i64.to_le_bytes().to_vec();
        for values in per_datum {
            data.extend(f32_bytes(values));
            offsets.extend((data.len() as i64).to_le_bytes());
        }
        tensor.bytes(1, &data);
        tensor.bytes(2, &offsets);
        tensor.uint(3, DTYPE_FLOAT32);
        let mut entry = Writer::default();
        entry.bytes(1, name.as_bytes());
        entry.message(2, tensor);
        record.message(2, entry);
    }
    record.uint(3, num_datums as u64);
    out.message(2, record);
    for (name, value) in metrics {
        let mut entry = Writer::default();
        entry.bytes(1, name.as_bytes());
        entry.double(2, *value);
        out.message(3, entry);
    }
    out.buf
}

/// One sampled sequence of a `SampleResponse`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sequence {
    /// `true`: stopped by a stop sequence or the end token; else the length limit.
    pub stopped: bool,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
}

/// `SampleResponse`: the sequences and, when asked, the prompt's logprobs (NaN where none, as
/// at the first token).
pub fn sample_response(sequences: &[Sequence], prompt_logprobs: Option<&[f32]>) -> Vec<u8> {
    let mut out = Writer::default();
    for s in sequences {
        let mut m = Writer::default();
        m.uint(1, if s.stopped { 0 } else { 1 });
        let tokens: Vec<u8> = s.tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        m.bytes(2, &tokens);
        m.bytes(3, &f32_bytes(&s.logprobs));
        out.message(1, m);
    }
    if let Some(lps) = prompt_logprobs {
        out.bytes(2, &f32_bytes(lps));
    }
    out.buf
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_reads_back_as_written() {
        let mut data = Datum {
            chunks: vec![Chunk::Tokens(vec![5, 7])],
            ..Datum::default()
        };
        data.loss_fn_inputs
            .insert("weights".into(), Tensor::f32(&[0.5, 1.0]));
        data.loss_fn_inputs
            .insert("target_tokens".into(), Tensor::i64(&[7, 9]));
        let req = ForwardBackwardRequest {
            model_id: "m1".into(),
            seq_id: 3,
            data: vec![data],
            loss_fn: "cross_entropy".into(),
            loss_fn_config: [("clip".to_owned(), ConfigValue::Number(0.25))].into(),
            forward_only: true,
        };
        let bytes = req.encode();
        assert_eq!(ForwardBackwardRequest::decode(&bytes).unwrap(), req);
        let mut req = Writer { buf: bytes };
        // A field temper does not know is skipped.
        req.uint(99, 1);
        let r = ForwardBackwardRequest::decode(&req.buf).unwrap();
        assert_eq!(r.model_id, "m1");
        assert_eq!(r.seq_id, 3);
        assert!(r.forward_only);
        assert_eq!(r.loss_fn, "cross_entropy");
        assert_eq!(r.loss_fn_config["clip"], ConfigValue::Number(0.25));
        assert_eq!(r.data[0].chunks, vec![Chunk::Tokens(vec![5, 7])]);
        let w = &r.data[0].loss_fn_inputs["weights"];
        assert_eq!(w.shape, vec![2]);
        assert_eq!(w.values().unwrap(), vec![0.5, 1.0]);
        let t = &r.data[0].loss_fn_inputs["target_tokens"];
        assert_eq!(t.values().unwrap(), vec![7.0, 9.0]);
        assert!(ForwardBackwardRequest::decode(&[0x0a, 0x05, 1]).is_err());
    }
}
