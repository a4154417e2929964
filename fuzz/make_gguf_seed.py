"""Writes the GGUF seed of fuzz/corpus/gguf: a small file by gguf-py's GGUFWriter (llama.cpp's own
writer) with a value of every metadata type, a nested array and tensors of the types ShardRL reads.

usage: make_gguf_seed.py OUT.gguf
"""
import sys

import gguf
import numpy as np

writer = gguf.GGUFWriter(sys.argv[1], "llama")
writer.add_uint8("seed.u8", 7)
writer.add_int8("seed.i8", -7)
writer.add_uint16("seed.u16", 700)
writer.add_int16("seed.i16", -700)
writer.add_uint32("general.alignment", 32)
writer.add_int32("seed.i32", -70000)
writer.add_float32("seed.f32", 1e-5)
writer.add_bool("seed.bool", True)
writer.add_string("seed.string", "héllo")
writer.add_array("tokenizer.ggml.tokens", ["a", "b", "<|im_end|>"])
writer.add_array("seed.nested", [[1, 2], [3]])
writer.add_uint64("seed.u64", 2**40)
writer.add_int64("seed.i64", -(2**40))
writer.add_float64("seed.f64", 0.1)
rng = np.random.default_rng(0)
writer.add_tensor("f32", rng.standard_normal((2, 4)).astype(np.float32))
writer.add_tensor("f16", rng.standard_normal((4,)).astype(np.float16))
q8 = gguf.quants.quantize(rng.standard_normal((1, 32)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
writer.add_tensor("q8_0", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
q4 = gguf.quants.quantize(rng.standard_normal((1, 32)).astype(np.float32), gguf.GGMLQuantizationType.Q4_1)
writer.add_tensor("q4_1", q4, raw_shape=q4.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
