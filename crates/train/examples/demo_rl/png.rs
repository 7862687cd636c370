//! A line plot written as an uncompressed PNG (stored deflate blocks): no plotting dependency.
//! Series are values in [0, 1] over equally spaced x; grid lines at every 0.25.

use std::path::Path;

const W: usize = 640;
const H: usize = 400;
const MARGIN: usize = 30;

pub fn plot(path: &Path, series: &[(&[f64], [u8; 3])]) -> std::io::Result<()> {
    let mut px = vec![255u8; W * H * 3];
    let set = |x: i64, y: i64, c: [u8; 3], px: &mut Vec<u8>| {
        if (0..W as i64).contains(&x) && (0..H as i64).contains(&y) {
            let i = (y as usize * W + x as usize) * 3;
            px[i..i + 3].copy_from_slice(&c);
        }
    };
    let (pw, ph) = ((W - 2 * MARGIN) as f64, (H - 2 * MARGIN) as f64);
    let to_y = |v: f64| (MARGIN as f64 + (1.0 - v.clamp(0.0, 1.0)) * ph).round() as i64;
    for k in 0..=4 {
        let y = to_y(k as f64 / 4.0);
        let shade = if k == 0 { [0, 0, 0] } else { [210, 210, 210] };
        for x in MARGIN..=W - MARGIN {
            set(x as i64, y, shade, &mut px);
        }
    }
    for y in MARGIN..=H - MARGIN {
        set(MARGIN as i64, y as i64, [0, 0, 0], &mut px);
    }
    for (values, color) in series {
        let n = values.len().max(2) - 1;
        let to_x = |i: usize| (MARGIN as f64 + i as f64 / n as f64 * pw).round() as i64;
        for (i, pair) in values.windows(2).enumerate() {
            let (x0, y0, x1, y1) = (to_x(i), to_y(pair[0]), to_x(i + 1), to_y(pair[1]));
            let steps = (x1 - x0).abs().max((y1 - y0).abs()).max(1);
            for s in 0..=steps {
                let x = x0 + (x1 - x0) * s / steps;
                let y = y0 + (y1 - y0) * s / steps;
                for (dx, dy) in [(0, 0), (0, 1), (1, 0), (0, -1), (-1, 0)] {
                    set(x + dx, y + dy, *color, &mut px);
                }
            }
        }
        for (i, v) in values.iter().enumerate() {
            for dy in -3..=3 {
                for dx in -3..=3 {
                    set(to_x(i) + dx, to_y(*v) + dy, *color, &mut px);
                }
            }
        }
    }
    std::fs::write(path, encode(&px))
}

fn encode(rgb: &[u8]) -> Vec<u8> {
    // Each row: filter byte 0, then the pixels.
    let mut raw = Vec::with_capacity(H * (W * 3 + 1));
    for row in rgb.chunks(W * 3) {
        raw.push(0);
        raw.extend_from_slice(row);
    }
    let mut zlib = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = raw.chunks(65_535).collect();
    for (i, block) in blocks.iter().enumerate() {
        zlib.push(u8::from(i + 1 == blocks.len()));
        let len = block.len() as u16;
        zlib.extend_from_slice(&len.to_le_bytes());
        zlib.extend_from_slice(&(!len).to_le_bytes());
        zlib.extend_from_slice(block);
    }
    zlib.extend_from_slice(&adler32(&raw).to_be_bytes());
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&(W as u32).to_be_bytes());
    ihdr.extend_from_slice(&(H as u32).to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]); // 8-bit RGB, deflate, no filter set, no interlace
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    for (kind, data) in [(b"IHDR", &ihdr), (b"IDAT", &zlib), (b"IEND", &Vec::new())] {
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let start = out.len();
        out.extend_from_slice(kind);
        out.extend_from_slice(data);
        let crc = crc32(&out[start..]);
        out.extend_from_slice(&crc.to_be_bytes());
    }
    out
}

fn adler32(data: &[u8]) -> u32 {
    let (mut a, mut b) = (1u32, 0u32);
    for &x in data {
        a = (a + u32::from(x)) % 65_521;
        b = (b + a) % 65_521;
    }
    (b << 16) | a
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &x in data {
        crc ^= u32::from(x);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}
