//! Malformed safetensors inputs: every problem is an error naming the file and the tensor, never
//! a panic, an overflow or a silently dropped value.

use fp4moe::layer_file::{self, Expected, LayerFile};
use fp4moe::quantize_file::quantize_tensors;
use fp4moe::spec::{Activation, Intermediate, LayerShape, MoeSpec, QuantMode, RoutingConfig};
use fp4moe::synthetic::{random_tokens, random_weights};
use fp4moe::tensor_io::{write_tensors, OwnedTensor};
use fp4moe::Error;
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

const E: usize = 4;
const H: usize = 32;
const I: usize = 32;

/// A fresh folder for one test.
fn scratch(test: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("fp4moe-file-errors-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn spec(quant: QuantMode) -> MoeSpec {
    MoeSpec {
        shape: LayerShape {
            hidden: H,
            intermediate: I,
            experts: E,
        },
        activation: Activation::Silu,
        quant,
        routing: RoutingConfig::softmax(2),
        shared_intermediate: None,
    }
}

/// The tensors and metadata of a valid layer file, to be corrupted one tensor at a time.
#[derive(Clone)]
struct Layer {
    tensors: BTreeMap<String, OwnedTensor>,
    metadata: HashMap<String, String>,
}

impl Layer {
    /// A valid gated SiLU layer (E 4, H 32, I 32, 3 tokens, router gate), W4A4 with input scales
    /// when `quant` asks for it.
    fn new(dir: &std::path::Path, quant: QuantMode) -> Self {
        let s = spec(quant);
        let mut weights = random_weights(&s, 5).unwrap();
        if let QuantMode::W4A4 { .. } = quant {
            weights.w13_input_scale = Some(vec![0.01; E]);
            weights.w2_input_scale = Some(vec![0.02; E]);
        }
        let lf = LayerFile {
            name: "base".into(),
            spec: s,
            weights,
            x: random_tokens(3, H, 6),
            tokens: 3,
            router_logits: None,
            expected: Expected::default(),
        };
        let path = dir.join("base.safetensors");
        layer_file::write(&path, &lf).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let tensors = st
            .tensors()
            .into_iter()
            .map(|(n, v)| {
                let t = OwnedTensor::bytes(v.dtype(), v.shape().to_vec(), v.data().to_vec());
                (n, t)
            })
            .collect();
        let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        let layer = Self {
            tensors,
            metadata: meta.metadata().clone().unwrap_or_default(),
        };
        layer_file::read(&layer.write(dir, "roundtrip")).unwrap();
        layer
    }

    fn set(&mut self, name: &str, t: OwnedTensor) -> &mut Self {
        self.tensors.insert(name.to_string(), t);
        self
    }

    fn remove(&mut self, name: &str) -> &mut Self {
        self.tensors.remove(name);
        self
    }

    fn write(&self, dir: &std::path::Path, name: &str) -> PathBuf {
        let path = dir.join(format!("{name}.safetensors"));
        let tensors: Vec<(String, OwnedTensor)> = self
            .tensors
            .iter()
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect();
        write_tensors(&path, &tensors, Some(self.metadata.clone())).unwrap();
        path
    }
}

/// Reads the layer as `name` and returns the `Error::File` message, which must name the file.
fn read_err(layer: &Layer, dir: &std::path::Path, name: &str) -> String {
    let path = layer.write(dir, name);
    match layer_file::read(&path) {
        Ok(_) => panic!("{name}: read succeeded"),
        Err(Error::File { path: p, message }) => {
            assert_eq!(p, path, "{name}: {message}");
            message
        }
        Err(e) => panic!("{name}: not a file error: {e}"),
    }
}

fn zeros_u8(shape: Vec<usize>) -> OwnedTensor {
    let n = shape.iter().product();
    OwnedTensor::bytes(Dtype::U8, shape, vec![0; n])
}

fn f32s(shape: Vec<usize>, fill: f32) -> OwnedTensor {
    let n: usize = shape.iter().product();
    OwnedTensor::f32(shape, &vec![fill; n])
}

#[test]
fn quantize_tensors_rejects_colliding_base_names() {
    let dir = scratch("collide");
    let input = dir.join("in.safetensors");
    let output = dir.join("out.safetensors");
    let t = f32s(vec![2, 16], 0.5);
    write_tensors(
        &input,
        &[
            ("a".to_string(), t.clone()),
            ("a.weight".to_string(), t.clone()),
            ("b.weight".to_string(), t),
        ],
        None,
    )
    .unwrap();
    match quantize_tensors(&input, &output) {
        Err(Error::File { path, message }) => {
            assert_eq!(path, input);
            assert!(
                message.contains("`a` and `a.weight`") && !message.contains("`b.weight`"),
                "{message}"
            );
        }
        other => panic!("expected a file error, got {other:?}"),
    }
    assert!(!output.exists(), "nothing may be written");
}

#[test]
fn zero_and_huge_dimensions_name_the_tensor() {
    let dir = scratch("dims");
    let base = Layer::new(&dir, QuantMode::W4A16);
    for (name, shape, fragment) in [
        ("experts0", vec![0, 2 * I, H / 2], "dimension 0 (experts E)"),
        ("rows0", vec![E, 0, H / 2], "dimension 1 (rows S*I)"),
        ("hidden0", vec![E, 2 * I, 0], "dimension 2 (H/2)"),
        // safetensors accepts any other dimension next to a zero one.
        ("huge", vec![1, 0, 1 << 63], "dimension 1 (rows S*I)"),
        (
            "huge_h",
            vec![0, 1 << 62, 1 << 63],
            "dimension 0 (experts E)",
        ),
    ] {
        let mut l = base.clone();
        l.set("w13_weight", zeros_u8(shape));
        let m = read_err(&l, &dir, name);
        assert!(
            m.starts_with("tensor `w13_weight`:") && m.contains(fragment),
            "{name}: {m}"
        );
    }
    // A shared expert whose width sits next to a zero hidden dimension.
    let mut l = base.clone();
    l.set("shared_w13_weight", f32s(vec![0, H], 0.0))
        .set("shared_w2_weight", f32s(vec![0, 1 << 63], 0.0));
    let m = read_err(&l, &dir, "shared_huge");
    assert!(m.starts_with("tensor `shared_w2_weight`:"), "{m}");
}

#[test]
fn sizes_from_tensor_shapes_name_the_tensor() {
    let dir = scratch("sizes");
    let base = Layer::new(&dir, QuantMode::W4A16);
    // H = 2 * 4 = 8: not a multiple of 16.
    let mut l = base.clone();
    l.set("w13_weight", zeros_u8(vec![E, 2 * I, 4]));
    let m = read_err(&l, &dir, "hidden8");
    assert!(
        m.starts_with("tensor `w13_weight`:") && m.contains("hidden size H = 8"),
        "{m}"
    );
    // I = 80 rows / 2 shards = 40.
    let mut l = base.clone();
    l.set("w13_weight", zeros_u8(vec![E, 80, H / 2]));
    let m = read_err(&l, &dir, "inter40");
    assert!(
        m.starts_with("tensor `w13_weight`:") && m.contains("= 40"),
        "{m}"
    );
    // Shared width 40.
    let mut l = base.clone();
    l.set("shared_w13_weight", f32s(vec![80, H], 0.1))
        .set("shared_w2_weight", f32s(vec![H, 40], 0.1));
    let m = read_err(&l, &dir, "shared40");
    assert!(
        m.starts_with("tensor `shared_w2_weight`:") && m.contains("Is = 40"),
        "{m}"
    );
    // Settings of the case itself still say `case`.
    let mut l = base.clone();
    let case = l.metadata["case"].replace("\"topk\":2", "\"topk\":9");
    l.metadata.insert("case".into(), case);
    let m = read_err(&l, &dir, "topk9");
    assert!(m.starts_with("case: top_k = 9"), "{m}");
}

#[test]
fn sharded_input_scales_are_checked_elementwise() {
    let dir = scratch("scales");
    let w4a4 = QuantMode::W4A4 {
        intermediate: Intermediate::Static,
    };
    for quant in [QuantMode::W4A16, w4a4] {
        let base = Layer::new(&dir, quant);
        // A valid [E, 2] scale reduces to the max over shards.
        let mut v = vec![0.01f32; 2 * E];
        v[5] = 0.03;
        let mut l = base.clone();
        l.set("w13_input_scale", OwnedTensor::f32(vec![E, 2], &v));
        let lf = layer_file::read(&l.write(&dir, "sharded_ok")).unwrap();
        assert_eq!(
            lf.weights.w13_input_scale,
            Some(vec![0.01, 0.01, 0.03, 0.01])
        );
        for bad in [f32::NAN, -1.0, 0.0, f32::INFINITY] {
            let mut v = vec![0.01f32; 2 * E];
            v[5] = bad; // expert 2, shard 1
            let mut l = base.clone();
            l.set("w2_input_scale", OwnedTensor::f32(vec![E, 2], &v));
            let m = read_err(&l, &dir, "sharded_bad");
            assert!(
                m.starts_with("tensor `w2_input_scale`:") && m.contains("expert 2, shard 1"),
                "{quant} {bad}: {m}"
            );
        }
    }
}

#[test]
fn shared_expert_needs_both_two_d_tensors() {
    let dir = scratch("shared");
    let base = Layer::new(&dir, QuantMode::W4A16);
    let w13 = f32s(vec![2 * 16, H], 0.1);
    let w2 = f32s(vec![H, 16], 0.1);

    let mut l = base.clone();
    l.set("shared_w13_weight", w13.clone())
        .set("shared_w2_weight", w2.clone());
    let lf = layer_file::read(&l.write(&dir, "shared_ok")).unwrap();
    assert_eq!(lf.spec.shared_intermediate, Some(16));
    assert!(lf.weights.shared.is_some());

    let mut only13 = l.clone();
    only13.remove("shared_w2_weight");
    let m = read_err(&only13, &dir, "only13");
    assert!(
        m.starts_with("tensor `shared_w2_weight`: missing") && m.contains("shared_w13_weight"),
        "{m}"
    );
    let mut only2 = l.clone();
    only2.remove("shared_w13_weight");
    let m = read_err(&only2, &dir, "only2");
    assert!(m.starts_with("tensor `shared_w13_weight`: missing"), "{m}");

    let mut flat = l.clone();
    flat.set("shared_w2_weight", f32s(vec![H * 16], 0.1));
    let m = read_err(&flat, &dir, "flat2");
    assert!(
        m.starts_with("tensor `shared_w2_weight`:") && m.contains("2 dimensions"),
        "{m}"
    );
    let mut flat = l.clone();
    flat.set("shared_w13_weight", f32s(vec![2 * 16 * H], 0.1));
    let m = read_err(&flat, &dir, "flat13");
    assert!(
        m.starts_with("tensor `shared_w13_weight`:") && m.contains("2 dimensions"),
        "{m}"
    );
    let mut narrow = l.clone();
    narrow.set("shared_w2_weight", f32s(vec![16, 16], 0.1));
    let m = read_err(&narrow, &dir, "narrow");
    assert!(m.starts_with("tensor `shared_w2_weight`:"), "{m}");
}

#[test]
fn non_finite_router_and_bias_name_the_file_tensor() {
    let dir = scratch("finite");
    let base = Layer::new(&dir, QuantMode::W4A16);
    let mut gate = vec![0.1f32; E * H];
    gate[H + 3] = f32::NAN;
    let mut l = base.clone();
    l.set("gate_weight", OwnedTensor::f32(vec![E, H], &gate));
    let m = read_err(&l, &dir, "gate_nan");
    assert!(
        m.starts_with("tensor `gate_weight`: non-finite value NaN at [1, 3]"),
        "{m}"
    );
    let mut l = base.clone();
    l.set(
        "e_score_correction_bias",
        OwnedTensor::f32(vec![E], &[0.0, 0.0, f32::INFINITY, 0.0]),
    );
    let m = read_err(&l, &dir, "bias_inf");
    assert!(
        m.starts_with("tensor `e_score_correction_bias`: non-finite value inf at [0, 2]"),
        "{m}"
    );
}
