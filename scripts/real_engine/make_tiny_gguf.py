"""Write a tiny random-weight llama GGUF (tokenizer copied from llama.cpp's vocab-only test file), for
the real tier (scripts/real_engine/build.sh runs it with the sdist's gguf-py on PYTHONPATH)."""
import sys, numpy as np
import gguf
src = sys.argv[1]; out = sys.argv[2]
r = gguf.GGUFReader(src)
n_vocab, n_embd, n_layer, n_head, n_ff, n_ctx = 32000, 64, 2, 4, 128, 2048
w = gguf.GGUFWriter(out, "llama")
w.add_name("tiny-random-llama")
w.add_context_length(n_ctx)
w.add_embedding_length(n_embd)
w.add_block_count(n_layer)
w.add_feed_forward_length(n_ff)
w.add_head_count(n_head)
w.add_head_count_kv(n_head)
w.add_rope_dimension_count(n_embd // n_head)
w.add_layer_norm_rms_eps(1e-5)
w.add_vocab_size(n_vocab)
w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
w.add_tokenizer_model("llama")
w.add_tokenizer_pre("default")
f = r.fields
toks = [bytes(f["tokenizer.ggml.tokens"].parts[i]).decode("utf-8", "replace") for i in f["tokenizer.ggml.tokens"].data]
scores = [float(f["tokenizer.ggml.scores"].parts[i][0]) for i in f["tokenizer.ggml.scores"].data]
types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
w.add_token_list(toks); w.add_token_scores(scores); w.add_token_types(types)
w.add_bos_token_id(1); w.add_eos_token_id(2); w.add_unk_token_id(0)
w.add_add_bos_token(True); w.add_add_eos_token(False)
w.add_chat_template("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
rng = np.random.default_rng(0)
def t(*shape): return (rng.standard_normal(shape) * 0.02).astype(np.float16)
w.add_tensor("token_embd.weight", t(n_vocab, n_embd))
w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
w.add_tensor("output.weight", t(n_vocab, n_embd))
for i in range(n_layer):
    w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
    for n in ("attn_q", "attn_k", "attn_v", "attn_output"):
        w.add_tensor(f"blk.{i}.{n}.weight", t(n_embd, n_embd))
    w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor(f"blk.{i}.ffn_gate.weight", t(n_ff, n_embd))
    w.add_tensor(f"blk.{i}.ffn_up.weight", t(n_ff, n_embd))
    w.add_tensor(f"blk.{i}.ffn_down.weight", t(n_embd, n_ff))
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
print("wrote", out)
