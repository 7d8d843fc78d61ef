// llama-replay: one row of logits, recomputed through the libllama a llama-server build links, in the batches a
// request was computed in (specharness: harness/backends/replay_tool.py writes its input and reads its output;
// docs/internals/triage.md, "Re-scoring through llama-server").
//
// The same procedure as the in-process engine's `replay_row` (harness/engine/score.py), in C++ against llama.h
// only, so it links the very libraries of any llama-server build (a tag, a bisect step, a CUDA build) and computes
// with its kernels. Compiled and linked by the build (harness/backends/build/replay_build.py) with llama-server's own
// link command.
//
// stdin, whitespace-separated after the first line:
//   line 1: the model path (the whole line)
//   n_ctx n_batch n_ubatch n_seq_max n_rs_seq kv_unified swa_full flash_attn type_k type_v threads repack row
//   n_decodes, then per decode:
//     seq start every_row keep n_tokens token... n_before (seq n every_row)... n_after (seq n every_row)...
// Each decode is one batch: the other slots' stand-in rows before (`n` rows of the decode's first token at
// positions 0.. of their own sequence), the request's rows (logits on every row or on the last only), the stand-ins
// after; then the stand-ins' sequences are cleared and, but after the last decode, the request's sequence is cut
// back to `keep` positions. Every sequence used is cleared first.
// stdout: "n_vocab\n", then the n_vocab float32 logits of row `row` of the last decode, native byte order.
// Errors: one line on stderr, exit 1 (bad input) or 2 (llama.cpp refused).

#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <set>
#include <string>
#include <vector>

struct StandIn {
    int seq, n, every;
};

struct Decode {
    int seq, start, every_row, keep;
    std::vector<llama_token> tokens;
    std::vector<StandIn> before, after;
};

[[noreturn]] static void fail(int code, const std::string & why) {
    std::fprintf(stderr, "llama-replay: %s\n", why.c_str());
    std::exit(code);
}

static void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        std::fputs(text, stderr);
    }
}

static std::vector<StandIn> read_stand_ins(std::istream & in) {
    int count = 0;
    if (!(in >> count) || count < 0) fail(1, "bad stand-in count");
    std::vector<StandIn> out(count);
    for (auto & s : out) {
        if (!(in >> s.seq >> s.n >> s.every)) fail(1, "bad stand-in entry");
    }
    return out;
}

static void add(llama_batch & batch, llama_token token, int pos, int seq, bool logits) {
    const int i = batch.n_tokens++;
    batch.token[i] = token;
    batch.pos[i] = pos;
    batch.n_seq_id[i] = 1;
    batch.seq_id[i][0] = seq;
    batch.logits[i] = logits;
}

static void add_stand_in(llama_batch & batch, const StandIn & s, llama_token token) {
    for (int i = 0; i < s.n; i++) {
        add(batch, token, i, s.seq, s.every || i == s.n - 1);
    }
}

int main() {
    std::string model_path;
    if (!std::getline(std::cin, model_path) || model_path.empty()) fail(1, "no model path on the first line");
    int n_ctx, n_batch, n_ubatch, n_seq_max, n_rs_seq, kv_unified, swa_full, flash_attn, type_k, type_v, threads,
        repack, row, n_decodes;
    if (!(std::cin >> n_ctx >> n_batch >> n_ubatch >> n_seq_max >> n_rs_seq >> kv_unified >> swa_full >> flash_attn >>
          type_k >> type_v >> threads >> repack >> row >> n_decodes) || n_decodes < 1) {
        fail(1, "bad context line or decode count");
    }
    std::vector<Decode> decodes(n_decodes);
    size_t widest = 0;
    for (auto & d : decodes) {
        int n = 0;
        if (!(std::cin >> d.seq >> d.start >> d.every_row >> d.keep >> n) || n < 1) fail(1, "bad decode header");
        d.tokens.resize(n);
        for (auto & t : d.tokens) {
            if (!(std::cin >> t)) fail(1, "bad token");
        }
        d.before = read_stand_ins(std::cin);
        d.after = read_stand_ins(std::cin);
        size_t width = d.tokens.size();
        for (const auto & s : d.before) width += s.n;
        for (const auto & s : d.after) width += s.n;
        widest = std::max(widest, width);
    }

    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    llama_model_params mparams = llama_model_default_params();
    mparams.use_extra_bufts = repack != 0;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mparams);
    if (model == nullptr) fail(2, "llama.cpp could not load the model " + model_path);
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = n_ctx;
    cparams.n_batch = n_batch;
    cparams.n_ubatch = n_ubatch;
    cparams.n_seq_max = n_seq_max;
    cparams.n_rs_seq = n_rs_seq;
    cparams.kv_unified = kv_unified != 0;
    cparams.swa_full = swa_full != 0;
    cparams.flash_attn_type = static_cast<llama_flash_attn_type>(flash_attn);
    cparams.type_k = static_cast<ggml_type>(type_k);
    cparams.type_v = static_cast<ggml_type>(type_v);
    cparams.n_threads = threads;
    cparams.n_threads_batch = threads;
    cparams.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (ctx == nullptr) fail(2, "llama.cpp could not create the context");
    llama_memory_t mem = llama_get_memory(ctx);

    std::set<int> used;
    for (const auto & d : decodes) {
        used.insert(d.seq);
        for (const auto & s : d.before) used.insert(s.seq);
        for (const auto & s : d.after) used.insert(s.seq);
    }
    for (int seq : used) llama_memory_seq_rm(mem, seq, -1, -1);

    llama_batch batch = llama_batch_init(static_cast<int32_t>(widest), 0, 1);
    int index = -1;
    for (size_t n = 0; n < decodes.size(); n++) {
        const Decode & d = decodes[n];
        batch.n_tokens = 0;
        for (const auto & s : d.before) add_stand_in(batch, s, d.tokens[0]);
        const int first = batch.n_tokens;
        const int last = static_cast<int>(d.tokens.size()) - 1;
        for (int i = 0; i <= last; i++) add(batch, d.tokens[i], d.start + i, d.seq, d.every_row || i == last);
        for (const auto & s : d.after) add_stand_in(batch, s, d.tokens[0]);
        if (llama_decode(ctx, batch) != 0) fail(2, "llama_decode failed on the batch at position " + std::to_string(d.start));
        for (const auto & s : d.before) llama_memory_seq_rm(mem, s.seq, -1, -1);
        for (const auto & s : d.after) llama_memory_seq_rm(mem, s.seq, -1, -1);
        if (n + 1 < decodes.size()) {
            if (d.keep < d.start + last + 1 && !llama_memory_seq_rm(mem, d.seq, d.keep, -1)) {
                fail(2, "could not cut the sequence back to " + std::to_string(d.keep) + " positions");
            }
            continue;
        }
        if (row < 0 || row > last || (!d.every_row && row != last)) fail(1, "row " + std::to_string(row) + " has no logits");
        index = first + row;
    }
    const float * logits = llama_get_logits_ith(ctx, index);
    if (logits == nullptr) fail(2, "no logits for the row");
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::printf("%d\n", n_vocab);
    std::fflush(stdout);
    if (std::fwrite(logits, sizeof(float), n_vocab, stdout) != static_cast<size_t>(n_vocab)) fail(2, "short write");
    std::fflush(stdout);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
