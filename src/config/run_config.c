/* Run configuration: defaults, the table of known keys, dotted overrides and
 * validation (the YAML dump and --help: dump.c). LitGPT's names and defaults throughout. */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "config-impl.h"
#include "fitllm/mem.h"
#include "fitllm/precision.h"

void fl_cfg_defaults(fl_run_config *c, fl_cmd_kind cmd) {
    memset(c, 0, sizeof *c);
    c->command = cmd;
    snprintf(c->out_dir, sizeof c->out_dir, "%s", cmd == FL_CMD_PRETRAIN ? "out/pretrain"
                                                  : cmd == FL_CMD_FINETUNE_LORA ? "out/finetune/lora" : "out/finetune/full");
    /* litgpt/finetune/lora.py defaults */
    c->lora.r = 8;
    c->lora.alpha = 16;
    c->lora.dropout = 0.05f;
    c->lora.query = 1;
    c->lora.value = 1;
    snprintf(c->precision, sizeof c->precision, "32-true");
    c->devices = 1;
    c->num_nodes = 1;
    c->tensor_parallel = 1;
    c->pipeline_parallel = 1;
    snprintf(c->pipeline_schedule, sizeof c->pipeline_schedule, "1f1b");
    c->pipeline_chunks = 2;
    snprintf(c->strategy, sizeof c->strategy, "auto");
    snprintf(c->state_dict_type, sizeof c->state_dict_type, "full");
    c->offload_prefetch = 1; /* the next unit, as FSDP's gather */
    c->offload_overlap = 1;
    c->offload_update_overlap = 1;
    c->bucket_size = (size_t)256 << 20; /* between PyTorch DDP's 25 MB and Lightning DeepSpeed's 2e8 elements */
    snprintf(c->resume, sizeof c->resume, "false");
    c->seed = cmd == FL_CMD_PRETRAIN ? 42 : 1337;
    snprintf(c->logger_name, sizeof c->logger_name, "csv");
    fl_data_config_default(&c->data, cmd == FL_CMD_PRETRAIN ? FL_DATA_TEXTFILES : FL_DATA_SYNTHETIC);
    fl_train_args *t = &c->train;
    if (cmd == FL_CMD_PRETRAIN) { /* litgpt/pretrain.py setup() */
        t->save_interval = 1000; t->log_interval = 1; t->global_batch_size = 512; t->micro_batch_size = 4;
        t->lr_warmup_steps = 2000; t->epochs = -1; t->max_tokens = -1; t->max_seq_length = -1;
        t->min_lr = 4e-5f;
    } else { /* litgpt/finetune/full.py setup() */
        t->save_interval = 1000; t->log_interval = 1; t->global_batch_size = 16; t->micro_batch_size = 1;
        t->lr_warmup_steps = 100; t->epochs = 5; t->max_tokens = -1; t->max_seq_length = -1;
        t->min_lr = 6e-5f;
    }
    t->lr_warmup_fraction = -1;
    t->max_steps = -1;
    t->max_time = -1;
    t->tie_embeddings = -1;
    t->activation_checkpointing = -1;
    t->max_norm = 0;
    t->save_on_signal = 1;
    t->divergence_check = 1;
    c->eval.interval = cmd == FL_CMD_PRETRAIN ? 1000 : cmd == FL_CMD_FINETUNE_LORA ? 100 : 600;
    c->eval.max_new_tokens = 100;
    c->eval.max_iters = 100;
    c->eval.initial_validation = 0;
    c->eval.final_validation = 1;
    fl_optim_config_default(&c->optimizer, FL_OPT_ADAMW);
    if (cmd == FL_CMD_PRETRAIN) { /* pretrain's default optimizer: AdamW lr 4e-4, wd 0.1, betas (0.9, 0.95) */
        c->optimizer.lr = 4e-4f; c->optimizer.weight_decay = 0.1f; c->optimizer.beta2 = 0.95f;
    }
}

/* ---- the key table ------------------------------------------------------- */

#define OFF(f) offsetof(fl_run_config, f)
static const fl_cfg_key k_keys[] = {
    {"checkpoint_dir", FL_CK_PATH, OFF(checkpoint_dir), "base model folder (HF layout), a Hugging Face repo id ORG/NAME (downloaded: `fitllm download`, or in the HF cache) or a preset name (random weights)"},
    {"model", FL_CK_PATH, OFF(checkpoint_dir), "same as checkpoint_dir (a preset name: random init)"},
    {"out_dir", FL_CK_PATH, OFF(out_dir), "folder for checkpoints and logs"},
    {"precision", FL_CK_PRECISION, OFF(precision), "32-true | bf16-true | bf16-mixed | 16-true | 16-mixed"},
    {"devices", FL_CK_DEVICES, OFF(devices), "devices (ranks) per node, or auto (1 CPU device); > 1: data parallel over devices x num_nodes ranks"},
    {"num_nodes", FL_CK_POS, OFF(num_nodes), "number of nodes"},
    {"tensor_parallel", FL_CK_POS, OFF(tensor_parallel), "ranks per tensor-parallel group (Megatron-style: attention heads and MLP columns split over them, and the token embeddings, lm_head and cross-entropy vocabulary-parallel (V/N rows each; the counts differ by one when N does not divide the vocabulary); finetune_full, pretrain and LoRA fine-tuning (the adapters split with their linears) of LLaMA, GPT-2, OPT and T5 (both stacks; the cross-attention and relative position bias by heads); checkpoints consolidated, resumable at any size); devices x num_nodes = data-parallel groups x tensor_parallel (DDP, ZeRO-1, ZeRO-2, FULL_SHARD / ZeRO-3 or HYBRID_SHARD (a node holding whole groups) on the data-parallel axis; the optimizer and parameter offload strategies (*_offload, fsdp_cpu_offload, ..._nvme: each rank's part of its slice in the host tier or NVMe files, the same bits; on the 3D grid too); QLoRA: a rank's part of a 4-bit weight that cuts the blocks of 64 keeps the whole blocks covering it, CPU backends and CUDA (EXPERIMENTAL: emulator-verified)); with pipeline_parallel the 3D grid (EXPERIMENTAL): data-parallel groups x tensor_parallel x pipeline_parallel, each rank its slice of its stage; default 1"},
    {"sequence_parallel", FL_CK_BOOL, OFF(sequence_parallel), "with tensor_parallel N > 1: Megatron-LM's sequence parallelism: between the tensor-parallel linears (norms, residual adds) each rank holds T/N of the sequence's rows instead of a replicated copy, so the residual stream, the mid residual and the norms' statistics saved for the backward are 1/N; a reduce-scatter after each row-parallel linear and an all-gather before each column-parallel one replace the all-reduces (the same bytes moved). Any sequence length (the activations' T rounded up to a multiple of N, a batch padded at each sequence's end where N does not divide its rows); LLaMA, GPT-2, OPT (also with pipeline_parallel, the interleaved schedule too: a stage sends the next its rank's rows) and T5 / Flan-T5 (both stacks; batches whose rows N does not divide run masked padding sequences); default false"},
    {"pipeline_parallel", FL_CK_POS, OFF(pipeline_parallel), "EXPERIMENTAL: stages per pipeline (GPipe / 1F1B pipeline parallelism): each rank of a pipeline holds a contiguous range of the decoder's blocks (balanced by their training FLOPs, lm_head's counted on the last; the first also runs the embeddings, the last the final norm, lm_head and loss), the micro-batches of a step are its gradient accumulation steps, activations and their gradients travel between neighbouring stages; finetune_full, pretrain and LoRA / QLoRA fine-tuning (each stage keeps the whole model's 4-bit stores) of LLaMA, GPT-2, OPT, and finetune_full / finetune_lora of T5 / Flan-T5 (the stages split [encoder blocks; decoder blocks]; gpipe, 1f1b or interleaved, any strategy between pipelines, tensor_parallel and sequence_parallel too); devices x num_nodes = pipelines (DDP, ZeRO-1, ZeRO-2, FULL_SHARD / ZeRO-3 or HYBRID_SHARD between them) x pipeline_parallel; the offload strategies (*_offload, fsdp_cpu_offload, ..._nvme) too under every schedule, each stage's (chunk's) optimizer state, and under parameter offload its pieces, in the host tier or NVMe files, the same bits as without (T5's stages too); checkpoints consolidated as one process writes them; default 1"},
    {"pipeline_schedule", FL_CK_STR32, OFF(pipeline_schedule), "EXPERIMENTAL, with --pipeline_parallel: gpipe (every forward, then every backward: each stage keeps all the step's micro-batches in flight) | 1f1b (default: stage s keeps at most min(stages - s, micro-batches) in flight) | interleaved (Megatron's interleaved 1F1B: each rank holds pipeline_chunks model chunks of non-contiguous blocks, chunk c of stage s being virtual stage c x stages + s; the bubble shrinks to (stages - 1) / (micro-batches x chunks + stages - 1); the micro-batches must be a multiple of the stages; DDP, ZeRO-1, ZeRO-2, FULL_SHARD / ZeRO-3 or HYBRID_SHARD on the data-parallel axis, 16-mixed loss scaling; finetune_full, finetune_lora (QLoRA too) and pretrain; T5 / Flan-T5 too; --tensor_parallel and --sequence_parallel (any data-parallel strategy above), each chunk a slice of its virtual stage (T5's too))"},
    {"pipeline_chunks", FL_CK_POS, OFF(pipeline_chunks), "EXPERIMENTAL, with --pipeline_schedule interleaved: model chunks (virtual stages) per rank, 1 to 8 (stages x chunks <= the blocks); default 2"},
    {"strategy", FL_CK_STR32, OFF(strategy), "auto | ddp | deepspeed_stage_1 | deepspeed_stage_2 | deepspeed_stage_3 | deepspeed_stage_1_offload | deepspeed_stage_2_offload | deepspeed_stage_3_offload | deepspeed_stage_3_offload_nvme | fsdp | fsdp_cpu_offload (auto, as LitGPT: fsdp FULL_SHARD for finetune_full and pretrain, ddp over the adapters for adapter fine-tuning, on CPUs and GPUs; a BLIP-2 folder: ddp, Lightning's default; on a --tensor_parallel / --pipeline_parallel grid the data axis's by the per-rank plan: the first of ddp, deepspeed_stage_1, deepspeed_stage_2, fsdp, the offloads whose every rank fits --max_memory (none given: ddp), the reason printed; ZeRO-1/2 shard the optimizer state / gradients; ZeRO-3 = fsdp FULL_SHARD also the parameters, gathered block by block; *_offload: ZeRO-Offload, the optimizer state in host memory outside the device budget and the update on the host's cores, AdamW or SGD, one device or several; deepspeed_stage_3_offload: ZeRO-3 with the optimizer offloaded, the parameters' shards on the devices unless --offload_param_device cpu|nvme; fsdp_cpu_offload: FULL_SHARD with the parameters' and gradients' shards and the optimizer in host memory (Lightning's FSDP cpu_offload); deepspeed_stage_3_offload_nvme: ZeRO-3 with the parameters and the optimizer state in NVMe files under nvme_path (ZeRO-Infinity); one process or several)"},
    {"fsdp.sharding_strategy", FL_CK_STR32, OFF(sharding_strategy), "--strategy fsdp: FULL_SHARD (default; = ZeRO-3: parameters, gradients and optimizer state divided by the ranks) | SHARD_GRAD_OP (= ZeRO-2) | NO_SHARD (= ddp) | HYBRID_SHARD (FULL_SHARD within each node of --devices ranks, replicated across --num_nodes; pretrain's auto across nodes)"},
    {"fsdp.backward_prefetch", FL_CK_STR32, OFF(backward_prefetch), "--strategy fsdp FULL_SHARD / HYBRID_SHARD: BACKWARD_PRE or true (default: in backward the next unit's all-gather is posted while this one computes, PyTorch FSDP's default) | off or false (PyTorch's None: each unit gathered when its backward starts; less GATHER memory, no overlap)"},
    {"offload_optimizer_device", FL_CK_STR32, OFF(offload_device), "with --strategy deepspeed_stage_1_offload / _2_offload / _3_offload (refused with any other strategy): cpu (default: the optimizer state in host memory) | nvme (ZeRO-Infinity's: in files under nvme_path, read and written piece by piece through a few pieces of host memory; for a host too small for the state)"},
    {"nvme_path", FL_CK_PATH, OFF(nvme_path), "offload_optimizer_device nvme or offload_param_device nvme (refused without them): the folder for the state and parameter files (default: out_dir); the files are unlinked at creation, so nothing is left behind"},
    {"offload_param_device", FL_CK_STR32, OFF(offload_param_device), "none (default, but cpu under fsdp_cpu_offload and nvme under deepspeed_stage_3_offload_nvme: the parameters' shards on the device) | cpu | nvme: parameter offload (DeepSpeed's offload_param, Lightning's fsdp_cpu_offload), with the ZeRO-3 offload strategies only: each rank's parameter and gradient shards live in host memory (cpu) or in files under nvme_path (nvme), each unit is copied to the device ahead of its forward and backward and dropped after, its gradient reduced and sent back to the host shard; the update runs on the host. Same bits as the device-resident run"},
    {"offload_prefetch", FL_CK_INT, OFF(offload_prefetch), "parameter offload (offload_param_device cpu|nvme): how far ahead units are fetched; 1 (default): the next unit's copy to the device and its all-gather are posted while this one computes, in forward and backward (FSDP's prefetch), and on nvme its piece is read from the files ahead; N > 1: on nvme the next N units' pieces are read ahead; 0: each unit fetched when it is needed (least device memory, no overlap). Same bits at any depth"},
    {"offload_overlap", FL_CK_BOOL, OFF(offload_overlap), "parameter offload with offload_prefetch >= 1: true (default): a worker thread copies each unit fetched ahead out of the host tier or the NVMe files while the unit before it computes (on a GPU into page-locked staging, then up: EXPERIMENTAL); false: the copy runs on the model's thread when the unit is posted. Same bits either way"},
    {"offload_update_overlap", FL_CK_BOOL, OFF(offload_update_overlap), "ZeRO-3 / FULL_SHARD with the optimizer offloaded (deepspeed_stage_3_offload, fsdp_cpu_offload, ..._nvme), without gradient clipping (train.max_norm null or 0) and loss scaling (16-mixed / 16-true): true (default): each unit's update runs on the host as soon as its gradient is final, on the fetch worker thread, beside the rest of the backward, its fetches and reductions (pipeline stages: beside the rest of the schedule; not T5's); false: the whole update after the backward. With clipping or loss scaling the update needs every unit's gradient first and runs after the backward either way. Same bits either way"},
    {"bucket_size", FL_CK_BYTES, OFF(bucket_size), "data parallel: the bytes of one bucket of the gradient reductions (ZeRO-2's reduce-scatter, FULL_SHARD's per unit, DDP/ZeRO-1's all-reduce per layer group; DeepSpeed's reduce_bucket_size in bytes): a reduction larger than it runs bucket by bucket, so its scratch (under twice the bucket) does not grow with the model; same bits at any size; null: one collective each"},
    {"fsdp.state_dict_type", FL_CK_STR32, OFF(state_dict_type), "checkpoints of every strategy: full (consolidated, one file set) | sharded (each rank writes its element ranges; resumable at any world size; fitllm merge_shards consolidates)"},
    {"resume", FL_CK_RESUME, OFF(resume), "false | true | auto | path to a checkpoint folder; refused (exit 2) when the checkpoint's hyperparameters.yaml names another model (another config.json architecture; the same one under another name: a note) or other settings its state depends on (optimizer, its state_dtype, LoRA rank / targets / lora_alpha / use_rslora, data, data.seed, data.val_split_fraction, data.n_train); settings that only change the steps to come (lr and schedule, batch, precision, seed, lora_dropout, ...) are said as notes"},
    {"seed", FL_CK_U64, OFF(seed), "random seed"},
    {"logger_name", FL_CK_LOGGER, OFF(logger_name), "csv | jsonl (metrics in out_dir/logs/, LitGPT's columns for every model (README 'Logs and metrics'): iter (micro-batches so far, every rank's), step (optimizer steps done), epoch (from 0), loss (nats), iter_time (s), tokens (this rank's so far: total_tokens / ranks), total_tokens (every rank's; padded B x T, BLIP-2 caption targets), learning_rate, val_loss, val_ppl, tok_s (tokens/s on one rank), mem_params/grads/optim/acts/workspace/other and mem_peak (bytes, rank 0), comm_sent (bytes sent in the step)); tensorboard, wandb, mlflow: csv"},
    {"model_name", FL_CK_STR64, OFF(model_name), "pretrain: model preset (or its LitGPT / HF name)"},
    {"model_config", FL_CK_MODEL_CONFIG, OFF(model_config), "pretrain: config.json, or LitGPT's mapping (model_config.n_layer ...)"},
    {"tokenizer_dir", FL_CK_PATH, OFF(tokenizer_dir), "tokenizer folder or file (default: the model folder's, or the one beside a model file; a preset: built-in bytes)"},
    {"initial_checkpoint_dir", FL_CK_PATH, OFF(checkpoint_dir), "pretrain: start from these weights"},
    {"data", FL_CK_DATA, 0, "Synthetic | Alpaca | JSON | TextFiles (or litgpt.data.* class_path); each class takes its own data.* options (the help of each names its classes), another class's is refused"},
    {"data.class_path", FL_CK_DATA, 0, "same as data"},
    {"data.json_path", FL_CK_PATH, OFF(data.json_path), "Alpaca/JSON: .json, .jsonl, or folder with train.json/val.json"},
    {"data.download_dir", FL_CK_DOWNLOAD_DIR, 0, "Alpaca: folder holding file_name (no downloads: must exist)"},
    {"data.file_name", FL_CK_FILE_NAME, 0, "Alpaca: file inside download_dir"},
    {"data.train_data_path", FL_CK_PATH, OFF(data.train_data_path), "TextFiles: training text folder (or one .txt file: its last val_split_fraction validates)"},
    {"data.val_data_path", FL_CK_PATH, OFF(data.val_data_path), "TextFiles: validation text folder or .txt file (null: the first train .txt in sorted order, as LitGPT; the run names it)"},
    {"data.prompt_style", FL_CK_STR32, OFF(data.prompt_style), "Synthetic/Alpaca/JSON: prompt style (alpaca)"},
    {"data.mask_prompt", FL_CK_BOOL, OFF(data.mask_prompt), "Synthetic/Alpaca/JSON: prompt tokens get ignore_index labels"},
    {"data.ignore_index", FL_CK_SINT, OFF(data.ignore_index), "Synthetic/Alpaca/JSON: label of masked tokens"},
    {"data.val_split_fraction", FL_CK_FLOAT, OFF(data.val_split_fraction), "fraction held out for validation (Alpaca/JSON; TextFiles with one train file); its default is the data class's: Alpaca 0.03865 (LitGPT's), Alpaca2k and JSON 0.05"},
    {"data.max_source_length", FL_CK_SINT, OFF(data.max_source_length), "encoder-decoder (T5): source tokens kept, EOS included (cut as HF's truncation=True; <= 0: no limit)"},
    {"data.max_target_length", FL_CK_SINT, OFF(data.max_target_length), "encoder-decoder (T5): target tokens kept, EOS included (<= 0: no limit)"},
    {"data.seed", FL_CK_U64, OFF(data.seed), "seed of the train/val split"},
    {"data.num_workers", FL_CK_IGNORED, 0, "accepted for LitGPT compatibility (data is tokenized once)"},
    {"data.n_train", FL_CK_INT, OFF(data.synthetic_train), "Synthetic: training samples"},
    {"data.n_val", FL_CK_INT, OFF(data.synthetic_val), "Synthetic: validation samples"},
    {"data.lengths", FL_CK_PATH, OFF(data.lengths), "Synthetic: sample lengths drawn from this quantile table (e.g. recipes/data/alpaca-lengths.tsv: Alpaca's measured lengths), cut to train.max_seq_length; tokens random letters, every one a target"},
    {"data.cache_dir", FL_CK_PATH, OFF(data.cache_dir), "tokenized-dataset cache folder"},
    {"train.save_interval", FL_CK_INT_OPT0, OFF(train.save_interval), "optimizer steps between checkpoints"},
    {"train.log_interval", FL_CK_POS, OFF(train.log_interval), "iterations between log lines"},
    {"train.global_batch_size", FL_CK_POS, OFF(train.global_batch_size), "samples per optimizer step"},
    {"train.micro_batch_size", FL_CK_POS, OFF(train.micro_batch_size), "samples per forward/backward"},
    {"train.lr_warmup_steps", FL_CK_INT_OPT, OFF(train.lr_warmup_steps), "optimizer steps of linear warmup"},
    {"train.lr_warmup_fraction", FL_CK_FLOAT_OPT, OFF(train.lr_warmup_fraction), "warmup as a fraction of an epoch (given alone, it replaces the default lr_warmup_steps)"},
    {"train.epochs", FL_CK_INT_OPT, OFF(train.epochs), "epochs to train"},
    {"train.max_tokens", FL_CK_LL_OPT, OFF(train.max_tokens), "stop after this many tokens: max_tokens // (global_batch_size x T) steps, as LitGPT (at least one)"},
    {"train.max_steps", FL_CK_INT_OPT, OFF(train.max_steps), "stop after this many optimizer steps"},
    {"train.max_time", FL_CK_FLOAT_OPT, OFF(train.max_time), "stop after this many seconds of training, then finish as at max_steps"},
    {"train.max_seq_length", FL_CK_INT_OPT, OFF(train.max_seq_length), "truncate samples to this length"},
    {"train.tie_embeddings", FL_CK_BOOL_OPT, OFF(train.tie_embeddings), "tie embedding and head weights"},
    {"train.max_norm", FL_CK_FLOAT_OPT0, OFF(train.max_norm), "gradient clipping norm (positive; 0 or null: no clipping)"},
    {"train.min_lr", FL_CK_FLOAT, OFF(train.min_lr), "final learning rate of the cosine decay"},
    {"train.learning_rate", FL_CK_FLOAT, OFF(optimizer.lr), "(older LitGPT recipes) same as optimizer.lr"},
    {"train.weight_decay", FL_CK_FLOAT, OFF(optimizer.weight_decay), "(older LitGPT recipes) optimizer.weight_decay"},
    {"train.beta1", FL_CK_FLOAT, OFF(optimizer.beta1), "(older LitGPT recipes) AdamW beta1"},
    {"train.beta2", FL_CK_FLOAT, OFF(optimizer.beta2), "(older LitGPT recipes) AdamW beta2"},
    {"train.activation_checkpointing", FL_CK_BOOL_OPT, OFF(train.activation_checkpointing), "recompute blocks in backward (null: on where --strategy auto shards finetune_full over several devices, as LitGPT's FSDP; off otherwise)"},
    {"train.keep_checkpoints", FL_CK_INT, OFF(train.keep_checkpoints), "keep only the newest N step-* checkpoints, 0 = all (fitllm)"},
    {"train.memory_snapshot_interval", FL_CK_INT, OFF(train.memory_snapshot_interval), "BLIP-2 fine-tuning: print the memory (allocated and its peak so far, per tag) at the four phases of steps 1, 2 and every N-th step, 0 = off (fitllm)"},
    {"train.save_on_signal", FL_CK_BOOL, OFF(train.save_on_signal), "on SIGINT (Ctrl-C), SIGTERM or SIGUSR1: finish the step, commit a step-* checkpoint, then stop (fitllm)"},
    {"train.divergence_check", FL_CK_BOOL, OFF(train.divergence_check), "stop with exit 1, no final/, when the loss stays above a uniform guess's ln(vocab_size) + 2 (20 steps of the smoothed training loss, or a validation) after warm-up (fitllm)"},
    {"eval.interval", FL_CK_POS, OFF(eval.interval), "optimizer steps between evaluations"},
    {"eval.max_new_tokens", FL_CK_INT_OPT0, OFF(eval.max_new_tokens), "tokens of the sample generation"},
    {"eval.max_iters", FL_CK_POS, OFF(eval.max_iters), "validation batches per evaluation"},
    {"eval.initial_validation", FL_CK_BOOL, OFF(eval.initial_validation), "evaluate before training"},
    {"eval.final_validation", FL_CK_BOOL, OFF(eval.final_validation), "evaluate after training"},
    {"eval.evaluate_example", FL_CK_IGNORED, 0, "accepted for LitGPT compatibility"},
    {"optimizer", FL_CK_OPTIMIZER, 0, "AdamW | Adam | SGD | bnb.optim.AdamW8bit | Adam8bit (bnb Paged* optimizers: refused, no CUDA paging)"},
    {"optimizer.class_path", FL_CK_OPTIMIZER, 0, "same as optimizer"},
    {"optimizer.lr", FL_CK_FLOAT, OFF(optimizer.lr), "learning rate"},
    {"optimizer.weight_decay", FL_CK_FLOAT, OFF(optimizer.weight_decay), "weight decay"},
    {"optimizer.betas", FL_CK_BETAS, 0, "AdamW betas [beta1, beta2]"},
    {"optimizer.eps", FL_CK_FLOAT, OFF(optimizer.eps), "AdamW epsilon"},
    {"optimizer.momentum", FL_CK_FLOAT, OFF(optimizer.momentum), "SGD momentum"},
    {"optimizer.dampening", FL_CK_FLOAT, OFF(optimizer.dampening), "SGD dampening"},
    {"optimizer.nesterov", FL_CK_BOOL, OFF(optimizer.nesterov), "SGD Nesterov momentum"},
    {"optimizer.state_dtype", FL_CK_STATE_DTYPE, OFF(optimizer.state_dtype), "optimizer state dtype: float32 | bfloat16 (fitllm)"},
    {"optimizer.optim_bits", FL_CK_IGNORED, 0, "accepted for bitsandbytes compatibility"},
    {"optimizer.min_8bit_size", FL_CK_IGNORED, 0, "accepted for bitsandbytes compatibility (4096)"},
    {"access_token", FL_CK_IGNORED, 0, "accepted for LitGPT compatibility (nothing is downloaded)"},
    {"log", FL_CK_IGNORED, 0, "LitGPT's logger settings (wandb / litlogger): accepted; fitllm writes CSV"},
    {"log.project", FL_CK_IGNORED, 0, "(LitGPT wandb) accepted"},
    {"log.run", FL_CK_IGNORED, 0, "(LitGPT wandb) accepted"},
    {"log.group", FL_CK_IGNORED, 0, "(LitGPT wandb) accepted"},
    {"log.teamspace", FL_CK_IGNORED, 0, "(LitGPT litlogger) accepted"},
    {"log.metadata", FL_CK_IGNORED, 0, "(LitGPT litlogger) accepted"},
    {"log.log_model", FL_CK_IGNORED, 0, "(LitGPT litlogger) accepted"},
    {"log.save_logs", FL_CK_IGNORED, 0, "(LitGPT litlogger) accepted"},
    {"log.checkpoint_name", FL_CK_IGNORED, 0, "(LitGPT litlogger) accepted"},
    {"init", FL_CK_INIT, OFF(init_random), "pretrained | random: random weights of the model's shape (fitllm; finetune_lora saves them once to out_dir/base, which its adapters name); hyperparameters.yaml records what the run started from (random: no weights read)"},
    {"lora_r", FL_CK_INT, OFF(lora.r), "finetune_lora: LoRA rank"},
    {"lora_alpha", FL_CK_FLOAT, OFF(lora.alpha), "finetune_lora: LoRA alpha (scaling alpha / r)"},
    {"lora_dropout", FL_CK_FLOAT, OFF(lora.dropout), "finetune_lora: dropout on the LoRA branch input"},
    {"lora_query", FL_CK_BOOL, OFF(lora.query), "finetune_lora: adapt the query projection (GPT-2: the q rows of the fused c_attn; the PEFT adapter is saved on the whole c_attn, the disabled parts' lora_B rows zero)"},
    {"lora_key", FL_CK_BOOL, OFF(lora.key), "finetune_lora: adapt the key projection (GPT-2: c_attn's k rows)"},
    {"lora_value", FL_CK_BOOL, OFF(lora.value), "finetune_lora: adapt the value projection (GPT-2: c_attn's v rows)"},
    {"lora_projection", FL_CK_BOOL, OFF(lora.projection), "finetune_lora: adapt the attention output projection (GPT-2: attn.c_proj)"},
    {"lora_mlp", FL_CK_BOOL, OFF(lora.mlp), "finetune_lora: adapt the MLP projections (GPT-2: c_fc and mlp.c_proj)"},
    {"lora_head", FL_CK_BOOL, OFF(lora.head), "finetune_lora: adapt lm_head (untied heads only; with tensor_parallel: A whole, B split by the head's vocabulary rows)"},
    {"lora_target_modules", FL_CK_PATH256, OFF(lora.target_modules), "finetune_lora: PEFT target modules (overrides lora_*; PEFT's meaning: a module whose name is the target or ends with .target, whole: GPT-2 c_attn all of q|k|v, c_proj both projections, attn.c_proj / mlp.c_proj one)"},
    {"use_rslora", FL_CK_BOOL, OFF(lora.use_rslora), "finetune_lora: scaling alpha / sqrt(r)"},
    {"quantize", FL_CK_STR32, OFF(lora.quantize), "finetune_lora (QLoRA): bnb.nf4 | bnb.nf4-dq | bnb.fp4 | bnb.fp4-dq"},
    {"max_memory", FL_CK_BYTES, OFF(max_memory), "allocator budget with its unit, e.g. 8GB or 8GiB; a bare number is refused (fitllm)"},
    {"threads", FL_CK_INT, OFF(threads), "CPU threads, 0 = all cores (fitllm; more than the cores: a warning)"},
    {"quiet", FL_CK_BOOL, OFF(quiet), "no progress bar (fitllm)"},
    {"overwrite", FL_CK_BOOL, OFF(overwrite), "start over in an out_dir that holds another run: its checkpoints (step-*, final/) are removed (fitllm)"},
    {"blip2.train", FL_CK_STR32, OFF(blip2_train), "a BLIP-2 checkpoint's parts that train: vision, qformer (with the query tokens and the language projection), lm, comma-separated (default qformer,lm; adapter fine-tuning: lm, its adapters; the vision tower frozen) (fitllm)"},
};
#undef OFF
#define N_KEYS (sizeof k_keys / sizeof k_keys[0])

/* The command an option belongs to when only one takes it (NULL: all do).
 * LitGPT's full and pretrain scripts have no LoRA or quantization arguments and
 * reject them; silently training full fp32 instead would waste the user's run. */
static const char *key_owner(const fl_cfg_key *k) {
    if (!strncmp(k->name, "lora_", 5) || !strcmp(k->name, "use_rslora") || !strcmp(k->name, "quantize"))
        return "finetune_lora";
    if (!strcmp(k->name, "model_name") || !strcmp(k->name, "model_config") || !strcmp(k->name, "initial_checkpoint_dir"))
        return "pretrain";
    return NULL;
}

static int key_applies(const fl_cfg_key *k, fl_cmd_kind cmd) {
    const char *o = key_owner(k);
    return !o || cmd == (!strcmp(o, "pretrain") ? FL_CMD_PRETRAIN : FL_CMD_FINETUNE_LORA);
}
int fl_cfg_key_applies(const fl_cfg_key *k, fl_cmd_kind cmd) { return key_applies(k, cmd); }

const fl_cfg_key *fl_cfg_keys(size_t *n) {
    *n = N_KEYS;
    return k_keys;
}


static const char *nearest_key(const char *key) {
    const char *best = NULL;
    size_t bd = (size_t)-1;
    for (size_t i = 0; i < N_KEYS; i++) {
        if (k_keys[i].type == FL_CK_IGNORED) continue; /* a typo is never meant for an option that does nothing */
        size_t d = fl_edit_distance(key, k_keys[i].name);
        /* also compare the last component, for "micro_batch_size" -> "train.micro_batch_size" */
        const char *dot = strrchr(k_keys[i].name, '.');
        if (dot) { size_t d2 = fl_edit_distance(key, dot + 1) + 1; if (d2 < d) d = d2; }
        if (d < bd) { bd = d; best = k_keys[i].name; }
    }
    /* a far-fetched suggestion ('bogus' -> 'model') misleads more than none */
    return bd <= 2 + strlen(key) / 4 ? best : NULL;
}

/* "data.init_args.x" -> "data.x", "optimizer.init_args.x" -> "optimizer.x". */
static void normalize_key(const char *key, char *out, size_t n) {
    const char *p = strstr(key, ".init_args.");
    if (p && (!strncmp(key, "data", 4) || !strncmp(key, "optimizer", 9))) {
        size_t pre = (size_t)(p - key);
        snprintf(out, n, "%.*s.%s", (int)pre, key, p + strlen(".init_args."));
    } else {
        snprintf(out, n, "%s", key);
    }
}

static int is_null(const char *v) { return !v || !*v || !strcmp(v, "null") || !strcmp(v, "~") || !strcasecmp(v, "none"); }
int fl_cfg_is_null(const char *v) { return is_null(v); }

static const fl_cfg_key *find_key(const char *key) {
    for (size_t i = 0; i < N_KEYS; i++)
        if (!strcmp(k_keys[i].name, key)) return &k_keys[i];
    return NULL;
}
const fl_cfg_key *fl_cfg_find_key(const char *key) { return find_key(key); }

void fl_cfg_canonical_key(const char *key_in, char *out, size_t n) {
    char key[256];
    normalize_key(key_in, key, sizeof key);
    const fl_cfg_key *k = find_key(key);
    /* two table entries that store the same field the same way are one option */
    if (k && k->type != FL_CK_IGNORED)
        for (size_t i = 0; i < N_KEYS; i++)
            if (k_keys[i].type == k->type && k_keys[i].off == k->off) { k = &k_keys[i]; break; }
    snprintf(out, n, "%s", k ? k->name : key);
}

/* Python / YAML 1.1 integers may group digits: 10_000. An underscore is dropped
 * only between two digits, so "_1" or "1__0" stay malformed. */
static const char *strip_digit_underscores(const char *v, char *buf, size_t n) {
    size_t o = 0, len = strlen(v);
    if (len >= n || !strchr(v, '_')) return v;
    for (size_t i = 0; i < len; i++) {
        if (v[i] == '_' && i > 0 && isdigit((unsigned char)v[i - 1]) && isdigit((unsigned char)v[i + 1])) continue;
        buf[o++] = v[i];
    }
    buf[o] = 0;
    return buf;
}

static fl_status parse_int(const char *key, const char *v_in, long long lo, long long hi, long long *out) {
    char ub[64];
    const char *v = strip_digit_underscores(v_in, ub, sizeof ub);
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi)
        return fl_errorf(FL_ERR_INVALID, "option '%s': '%s' is not an integer in [%lld, %lld]", key, v_in, lo, hi);
    *out = x;
    return FL_OK;
}

static fl_status parse_float(const char *key, const char *v_in, float *out) {
    char ub[64];
    const char *v = strip_digit_underscores(v_in, ub, sizeof ub);
    char *end;
    double x = strtod(v, &end);
    if (end == v || *end || !isfinite(x)) return fl_errorf(FL_ERR_INVALID, "option '%s': '%s' is not a number", key, v_in);
    if (fabs(x) > 3.4e38) return fl_errorf(FL_ERR_INVALID, "option '%s': '%s' is beyond the float range", key, v_in);
    *out = (float)x;
    return FL_OK;
}

static fl_status parse_bool(const char *key, const char *v, int *out) {
    if (!strcasecmp(v, "true") || !strcmp(v, "1") || !strcasecmp(v, "yes")) *out = 1;
    else if (!strcasecmp(v, "false") || !strcmp(v, "0") || !strcasecmp(v, "no")) *out = 0;
    else return fl_errorf(FL_ERR_INVALID, "option '%s': '%s' is not a boolean (true/false)", key, v);
    return FL_OK;
}

static fl_status set_data_kind(fl_run_config *c, const char *v) {
    const char *name = v;
    if (!strncmp(name, "litgpt.data.", 12)) name += 12;
    fl_data_kind k;
    /* Keep what the user set in data.* so the order of keys does not matter. */
    if (!strcmp(name, "Synthetic")) k = FL_DATA_SYNTHETIC;
    else if (!strcmp(name, "Alpaca") || !strcmp(name, "Alpaca2k") || !strcmp(name, "AlpacaGPT4") ||
             !strcmp(name, "AlpacaClean"))
        k = FL_DATA_ALPACA;
    else if (!strcmp(name, "JSON")) k = FL_DATA_JSON;
    else if (!strcmp(name, "TextFiles")) k = FL_DATA_TEXTFILES;
    else
        return fl_errorf(FL_ERR_UNSUPPORTED,
                         "data '%s' is not supported (Synthetic, Alpaca, Alpaca2k, AlpacaGPT4, JSON, TextFiles); a "
                         "recipe's can be replaced on the command line, e.g. --data TextFiles --data.train_data_path DIR",
                         v);
    if (c->data.kind != k) {
        /* a new data module starts from its own defaults; paths already given stay */
        fl_data_config old = c->data;
        fl_data_config_default(&c->data, k);
        memcpy(c->data.json_path, old.json_path, sizeof old.json_path);
        memcpy(c->data.train_data_path, old.train_data_path, sizeof old.train_data_path);
        memcpy(c->data.val_data_path, old.val_data_path, sizeof old.val_data_path);
        memcpy(c->data.cache_dir, old.cache_dir, sizeof old.cache_dir);
        memcpy(c->data.lengths, old.lengths, sizeof old.lengths);
    }
    if (k == FL_DATA_ALPACA && !strcmp(name, "Alpaca2k")) c->data.val_split_fraction = 0.05f;
    return FL_OK;
}

static fl_status set_optimizer(fl_run_config *c, const char *v) {
    const char *name = v;
    if (!strncmp(name, "torch.optim.", 12)) name += 12;
    else if (!strncmp(name, "bnb.optim.", 10)) name += 10;
    else if (!strncmp(name, "bitsandbytes.optim.", 19)) name += 19;
    fl_optim_kind kind;
    float wd = -1.0f; /* the class's default weight decay, when it differs from the kind's */
    if (!strncasecmp(name, "Paged", 5)) {
        /* bitsandbytes' paged optimizers keep their state in CUDA managed memory that the driver
         * pages out to host memory under GPU memory pressure. fitllm has no such paging: running
         * plain AdamW instead would silently drop what the recipe asked for */
        int eight = strstr(name, "8bit") != NULL;
        return fl_errorf(FL_ERR_UNSUPPORTED,
                         "optimizer '%s' is not implemented: paged optimizers keep their state in CUDA managed memory "
                         "that is paged out to host memory under GPU memory pressure, which fitllm does not do. "
                         "To keep the optimizer state in host memory use --strategy deepspeed_stage_2_offload "
                         "(--offload_optimizer_device cpu, the default); %s",
                         v, eight ? "for the 8-bit state on the device use bnb.optim.AdamW8bit"
                                  : "for a 4x smaller state on the device use bnb.optim.AdamW8bit; or torch.optim.AdamW");
    }
    if (!strcasecmp(name, "AdamW") || !strcasecmp(name, "AdamW32bit")) { /* bnb's AdamW32bit: AdamW, fp32 state */
        kind = FL_OPT_ADAMW;
    } else if (!strcasecmp(name, "Adam") || !strcasecmp(name, "Adam32bit")) {
        kind = FL_OPT_ADAMW, wd = 0.0f; /* torch Adam: weight decay 0 (and we apply it decoupled) */
    } else if (!strcasecmp(name, "SGD")) {
        kind = FL_OPT_SGD;
    } else if (!strcasecmp(name, "AdamW8bit")) {
        kind = FL_OPT_ADAMW8BIT;
    } else if (!strcasecmp(name, "Adam8bit")) {
        kind = FL_OPT_ADAMW8BIT, wd = 0.0f; /* bnb Adam8bit: same kernel, weight decay 0 */
    } else {
        return fl_errorf(FL_ERR_UNSUPPORTED,
                         "optimizer '%s' is not supported (AdamW, Adam, SGD, bnb.optim.AdamW8bit, bnb.optim.Adam8bit, "
                         "bnb.optim.AdamW32bit, bnb.optim.Adam32bit)", v);
    }
    if (c->optimizer.kind != kind) {
        fl_optim_config keep = c->optimizer;
        fl_optim_config_default(&c->optimizer, kind);
        c->optimizer.lr = keep.lr; /* an lr given before the class keeps applying */
    }
    if (wd >= 0) c->optimizer.weight_decay = wd;
    return FL_OK;
}

static fl_status set_precision(char *dst, const char *v) {
    static const char *ok[] = {"32-true", "bf16-true", "bf16-mixed", "16-true", "16-mixed", "32", "bf16", "16"};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
        if (!strcmp(v, ok[i])) {
            snprintf(dst, 16, "%s", !strcmp(v, "32") ? "32-true" : !strcmp(v, "bf16") ? "bf16-mixed"
                                     : !strcmp(v, "16") ? "16-mixed" : v);
            return FL_OK;
        }
    return fl_errorf(FL_ERR_INVALID, "precision '%s' is not one of 32-true, bf16-true, bf16-mixed, 16-true, 16-mixed", v);
}

/* model_config.<field> = value: checked here, kept as text (fl_cfg_model_config reads it). */
static fl_status set_model_field(fl_run_config *c, const char *key, const char *field, const char *v) {
    if (c->command != FL_CMD_PRETRAIN)
        return fl_errorf(FL_ERR_INVALID, "option '%s' applies to pretrain only (the model to create); %s takes its "
                         "model from checkpoint_dir", key, fl_cfg_command_name(c->command));
    FL_TRY(fl_cfg_model_field_check(field, v));
    size_t fl = strlen(field), vl = strlen(v);
    if (fl >= sizeof c->model_fields[0].key || vl >= sizeof c->model_fields[0].value)
        return fl_errorf(FL_ERR_INVALID, "option '%s': value too long", key);
    int i = 0;
    while (i < c->n_model_fields && strcmp(c->model_fields[i].key, field)) i++;
    if (i == c->n_model_fields) {
        if (i == FL_CFG_MODEL_FIELDS) return fl_errorf(FL_ERR_INVALID, "option '%s': too many model_config fields", key);
        c->n_model_fields++;
    }
    memcpy(c->model_fields[i].key, field, fl + 1);
    memcpy(c->model_fields[i].value, v, vl + 1);
    return FL_OK;
}

/* fl_cfg_set's option types with words of their own (precision, resume, logger, devices, the
 * optimizer and its betas, Alpaca's download_dir / file_name, ...). */
static fl_status set_special(fl_run_config *c, const fl_cfg_key *k, const char *key, const char *v) {
    char *base = (char *)c;
    long long x = 0;
    switch (k->type) {
    case FL_CK_PRECISION: return set_precision(base + k->off, v);
    case FL_CK_RESUME:
        if (is_null(v)) v = "false";
        if (!strcasecmp(v, "true") || !strcasecmp(v, "false") || !strcmp(v, "auto")) {
            char low[8];
            snprintf(low, sizeof low, "%s", v);
            for (char *p = low; *p; p++) *p = (char)tolower((unsigned char)*p);
            snprintf(c->resume, sizeof c->resume, "%s", low);
        } else {
            snprintf(c->resume, sizeof c->resume, "%s", v);
        }
        return FL_OK;
    case FL_CK_LOGGER:
        /* LitGPT's other loggers are accepted: the run writes CSV metrics and says so
         * (fl_trainer_run), rather than a recipe failing over where its charts go */
        if (strcmp(v, "csv") && strcmp(v, "jsonl") && strcmp(v, "tensorboard") && strcmp(v, "wandb") &&
            strcmp(v, "mlflow") && strcmp(v, "litlogger"))
            return fl_errorf(FL_ERR_UNSUPPORTED, "logger_name '%s' is not one of csv, jsonl (fitllm) or LitGPT's "
                             "tensorboard, wandb, mlflow, litlogger (written as csv here)", v);
        snprintf(c->logger_name, sizeof c->logger_name, "%s", v);
        return FL_OK;
    case FL_CK_DEVICES:
        /* LitGPT: "auto" (or -1) = every device there is; this build trains on one CPU device */
        if (!strcasecmp(v, "auto") || !strcmp(v, "-1")) { c->devices = 1, c->devices_auto = 1; return FL_OK; }
        FL_TRY(parse_int(key, v, 1, 1 << 20, &x));
        c->devices = (int)x, c->devices_auto = 0;
        return FL_OK;
    case FL_CK_MODEL_CONFIG:
        /* a config.json path, or null; either replaces a model_config mapping */
        c->n_model_fields = 0;
        if (is_null(v)) { c->model_config[0] = '\0'; return FL_OK; }
        if (strlen(v) >= FL_CFG_PATH) return fl_errorf(FL_ERR_INVALID, "option '%s': path too long", key);
        snprintf(c->model_config, sizeof c->model_config, "%s", v);
        return FL_OK;
    case FL_CK_DATA: return set_data_kind(c, v);
    case FL_CK_OPTIMIZER: return set_optimizer(c, v);
    case FL_CK_BETAS: {
        /* "[0.9, 0.95]" or "0.9,0.95" */
        char buf[128];
        snprintf(buf, sizeof buf, "%s", v);
        char *s = buf, *e;
        while (*s == '[' || *s == '(' || isspace((unsigned char)*s)) s++;
        double b1 = strtod(s, &e);
        if (e == s) goto bad_betas;
        s = e;
        while (*s == ',' || isspace((unsigned char)*s)) s++;
        double b2 = strtod(s, &e);
        if (e == s) goto bad_betas;
        s = e;
        while (*s == ']' || *s == ')' || isspace((unsigned char)*s)) s++;
        if (*s || !(b1 >= 0 && b1 < 1 && b2 >= 0 && b2 < 1)) goto bad_betas;
        c->optimizer.beta1 = (float)b1;
        c->optimizer.beta2 = (float)b2;
        return FL_OK;
    bad_betas:
        return fl_errorf(FL_ERR_INVALID, "option '%s': '%s' is not a pair of betas in [0, 1) like [0.9, 0.95]", key, v);
    }
    case FL_CK_DOWNLOAD_DIR:
    case FL_CK_FILE_NAME: {
        /* LitGPT's Alpaca reads download_dir/file_name (downloading when absent;
         * we never download, so the file must exist). Keep both parts in json_path. */
        char dir[FL_CFG_PATH], file[FL_CFG_PATH];
        const char *jp = c->data.json_path, *slash = strrchr(jp, '/');
        snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - jp) : 0, jp);
        snprintf(file, sizeof file, "%s", slash ? slash + 1 : jp);
        if (!dir[0]) snprintf(dir, sizeof dir, "data/alpaca");
        if (!file[0]) snprintf(file, sizeof file, "alpaca_data_cleaned_archive.json");
        if (k->type == FL_CK_DOWNLOAD_DIR) snprintf(dir, sizeof dir, "%s", v);
        else snprintf(file, sizeof file, "%s", v);
        if (strlen(dir) + strlen(file) + 2 > FL_CFG_PATH) return fl_errorf(FL_ERR_INVALID, "option '%s': path too long", key);
        snprintf(c->data.json_path, sizeof c->data.json_path, "%s/%s", dir, file);
        return FL_OK;
    }
    case FL_CK_INIT:
        if (!strcmp(v, "random")) c->init_random = 1;
        else if (!strcmp(v, "pretrained") || !strcmp(v, "checkpoint")) c->init_random = 0;
        else return fl_errorf(FL_ERR_INVALID, "option '%s': '%s' is not pretrained or random", key, v);
        return FL_OK;
    case FL_CK_STATE_DTYPE:
        if (!strcmp(v, "float32") || !strcmp(v, "fp32") || !strcmp(v, "f32")) c->optimizer.state_dtype = FL_F32;
        else if (!strcmp(v, "bfloat16") || !strcmp(v, "bf16")) c->optimizer.state_dtype = FL_BF16;
        else return fl_errorf(FL_ERR_INVALID, "option '%s': '%s' is not float32 or bfloat16", key, v);
        return FL_OK;
    case FL_CK_IGNORED: return FL_OK;
    default: break;
    }
    return fl_errorf(FL_ERR_INTERNAL, "option '%s': unhandled type", key);
}

fl_status fl_cfg_set(fl_run_config *c, const char *key_in, const char *v) {
    char key[256];
    normalize_key(key_in, key, sizeof key);
    if (!strncmp(key, "model_config.", 13)) return set_model_field(c, key_in, key + 13, v);
    if (!strncmp(key, "log.metadata.", 13)) return FL_OK; /* LitGPT's free-form logger tags */
    const fl_cfg_key *k = find_key(key);
    if (!k) {
        const char *near = nearest_key(key);
        return fl_errorf(FL_ERR_INVALID, "unknown option '%s'%s%s%s", key_in, near ? " (did you mean '" : "",
                         near ? near : "", near ? "'?)" : "");
    }
    /* pretrain's ways of naming the model to create (or its initial weights): a fine-tune takes its model from
     * checkpoint_dir, and these were silently ignored (model_name, model_config) or replaced it unsaid
     * (initial_checkpoint_dir is the same field); null (a recipe's "no value") is harmless */
    if (!key_applies(k, c->command) && !strcmp(key_owner(k), "pretrain")) {
        if (is_null(v)) return FL_OK;
        return fl_errorf(FL_ERR_INVALID, "option '%s' applies to pretrain only (the model to create); %s takes its "
                         "model from checkpoint_dir (its first argument)", key_in, fl_cfg_command_name(c->command));
    }
    if (!key_applies(k, c->command))
        return fl_errorf(FL_ERR_INVALID,
                         "option '%s' applies to %s only (fitllm %s ..., or fitllm plan ... --lora): %s trains "
                         "without LoRA and would ignore it", key_in, key_owner(k), key_owner(k),
                         c->command == FL_CMD_PRETRAIN ? "pretrain" : "finetune_full");
    char *base = (char *)c;
    long long x = 0;
    if (k->off == offsetof(fl_run_config, train.lr_warmup_steps) && k->type == FL_CK_INT_OPT) {
        c->lr_warmup_steps_given = 1;
    } else if (k->off == offsetof(fl_run_config, train.lr_warmup_fraction) && k->type == FL_CK_FLOAT_OPT &&
               !is_null(v) && !c->lr_warmup_steps_given) {
        /* a fraction given alone is the warm-up: the command's default steps (100, pretrain 2000)
         * give way (LitGPT refuses the pair even when the steps are only its default) */
        c->train.lr_warmup_steps = -1;
    }
    switch (k->type) {
    case FL_CK_PATH:
        if (is_null(v)) { ((char *)(base + k->off))[0] = '\0'; return FL_OK; }
        if (strlen(v) >= FL_CFG_PATH) return fl_errorf(FL_ERR_INVALID, "option '%s': path too long", key);
        snprintf(base + k->off, FL_CFG_PATH, "%s", v);
        return FL_OK;
    case FL_CK_STR32:
    case FL_CK_STR64: { /* too long is an error: cut short, a name would turn into another (or none) unsaid */
        size_t cap = k->type == FL_CK_STR32 ? 32 : 64;
        if (!is_null(v) && strlen(v) >= cap)
            return fl_errorf(FL_ERR_INVALID, "option '%s': '%s' is longer than %zu characters", key, v, cap - 1);
        snprintf(base + k->off, cap, "%s", is_null(v) ? "" : v);
        return FL_OK;
    }
    case FL_CK_PATH256: {
        /* a YAML list arrives as "[a, b]": keep the names, comma-separated */
        char buf[256];
        size_t o = 0;
        for (const char *q = is_null(v) ? "" : v; *q && o < sizeof buf - 1; q++)
            if (*q != '[' && *q != ']' && *q != ' ' && *q != '"' && *q != '\'') buf[o++] = *q;
        buf[o] = 0;
        if (o == sizeof buf - 1)
            return fl_errorf(FL_ERR_INVALID, "option '%s': the list is longer than %zu characters", key, sizeof buf - 2);
        snprintf(base + k->off, 256, "%s", buf);
        return FL_OK;
    }
    case FL_CK_SINT:
        FL_TRY(parse_int(key, v, -(1 << 30), 1 << 30, &x));
        *(int *)(base + k->off) = (int)x;
        return FL_OK;
    case FL_CK_POS: { /* the range named is the range accepted */
        char *end, ub[64];
        const char *vs = strip_digit_underscores(v, ub, sizeof ub);
        errno = 0;
        long long y = strtoll(vs, &end, 10);
        if (errno || end == vs || *end || y < 1 || y > (1 << 30))
            return fl_errorf(FL_ERR_INVALID, "option '%s': '%s' must be positive: an integer in [1, %d]", key, v, 1 << 30);
        *(int *)(base + k->off) = (int)y;
        return FL_OK;
    }
    case FL_CK_INT:
        FL_TRY(parse_int(key, v, 0, 1 << 30, &x));
        *(int *)(base + k->off) = (int)x;
        return FL_OK;
    case FL_CK_INT_OPT:
    case FL_CK_INT_OPT0:
        if (is_null(v)) { *(int *)(base + k->off) = k->type == FL_CK_INT_OPT ? -1 : 0; return FL_OK; }
        FL_TRY(parse_int(key, v, 0, 1 << 30, &x));
        *(int *)(base + k->off) = (int)x;
        return FL_OK;
    case FL_CK_LL_OPT:
        if (is_null(v)) { *(long long *)(base + k->off) = -1; return FL_OK; }
        FL_TRY(parse_int(key, v, 0, (long long)1 << 62, &x));
        *(long long *)(base + k->off) = x;
        return FL_OK;
    case FL_CK_U64:
        FL_TRY(parse_int(key, v, 0, (long long)1 << 62, &x));
        *(uint64_t *)(base + k->off) = (uint64_t)x;
        return FL_OK;
    case FL_CK_FLOAT: return parse_float(key, v, (float *)(base + k->off));
    case FL_CK_FLOAT_OPT:
    case FL_CK_FLOAT_OPT0:
        if (is_null(v)) { *(float *)(base + k->off) = k->type == FL_CK_FLOAT_OPT ? -1.0f : 0.0f; return FL_OK; }
        return parse_float(key, v, (float *)(base + k->off));
    case FL_CK_BOOL: return parse_bool(key, v, (int *)(base + k->off));
    case FL_CK_BOOL_OPT:
        if (is_null(v)) { *(int *)(base + k->off) = -1; return FL_OK; }
        return parse_bool(key, v, (int *)(base + k->off));
    case FL_CK_BYTES:
        if (is_null(v)) { *(size_t *)(base + k->off) = 0; return FL_OK; }
        if (fl_parse_bytes(v, (size_t *)(base + k->off)) != 0) {
            char why[300];
            return fl_errorf(FL_ERR_INVALID, "option '%s': %s", key, fl_bytes_refusal(v, why, sizeof why));
        }
        return FL_OK;
    default: return set_special(c, k, key, v); /* the types with words of their own */
    }
}

int fl_cfg_dp_ranks(const fl_run_config *c) {
    const int tp = (c->tensor_parallel > 1 ? c->tensor_parallel : 1) * (c->pipeline_parallel > 1 ? c->pipeline_parallel : 1);
    return c->devices * c->num_nodes / tp > 0 ? c->devices * c->num_nodes / tp : 1;
}

int fl_cfg_backward_prefetch(const fl_run_config *c) {
    const char *v = c->backward_prefetch;
    /* null (None, NONE, "") is the default here, as for every key: PyTorch's None (no prefetch) is "off" */
    if (!v[0] || !strcmp(v, "BACKWARD_PRE") || !strcmp(v, "true") || !strcmp(v, "on")) return 1;
    return !strcmp(v, "false") || !strcmp(v, "off") ? 0 : -1;
}

/* fsdp.sharding_strategy and fsdp.backward_prefetch: known values, and refused (never ignored) under a strategy that
 * does not use them (sc: the run's strategy resolved). */
static fl_status check_fsdp_options(const fl_run_config *c, const fl_strategy_choice *sc) {
    if (c->sharding_strategy[0] && strcmp(c->sharding_strategy, "NO_SHARD") &&
        strcmp(c->sharding_strategy, "SHARD_GRAD_OP") && strcmp(c->sharding_strategy, "FULL_SHARD") &&
        strcmp(c->sharding_strategy, "HYBRID_SHARD") && strcmp(c->sharding_strategy, "_HYBRID_SHARD_ZERO2"))
        return fl_errorf(FL_ERR_INVALID, "fsdp.sharding_strategy '%s': unknown (NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, "
                         "HYBRID_SHARD)", c->sharding_strategy);
    const char *strat = c->strategy[0] ? c->strategy : "auto";
    if (c->sharding_strategy[0] && strcmp(strat, "fsdp") && (strcmp(strat, "auto") || c->devices * c->num_nodes > 1))
        return fl_errorf(FL_ERR_INVALID, "fsdp.sharding_strategy %s applies to --strategy fsdp; this run's strategy is "
                         "'%s'%s", c->sharding_strategy, strat,
                         strcmp(strat, "auto") ? "" : " (auto picks its own sharding: give --strategy fsdp to choose it)");
    if (c->backward_prefetch[0] && fl_cfg_backward_prefetch(c) < 0)
        return fl_errorf(FL_ERR_INVALID, "fsdp.backward_prefetch '%s': unknown (BACKWARD_PRE or true, the default; off or false)",
                         c->backward_prefetch);
    /* like fsdp.sharding_strategy: refused where no unit is gathered (it was ignored under ddp) */
    if (c->backward_prefetch[0] && sc->stage != 3 && (strcmp(strat, "auto") || c->devices * c->num_nodes > 1))
        return fl_errorf(FL_ERR_INVALID, "fsdp.backward_prefetch %s applies to the units FSDP gathers (ZeRO-3: --strategy "
                         "fsdp with FULL_SHARD or HYBRID_SHARD, deepspeed_stage_3*, fsdp_cpu_offload); this run's "
                         "strategy is %s%s%s (ZeRO stage %d)", c->backward_prefetch, strcmp(strat, "auto") ? "'" : "",
                         strcmp(strat, "auto") ? strat : sc->desc, strcmp(strat, "auto") ? "'" : "", sc->stage);
    return FL_OK;
}

fl_status fl_cfg_validate(const fl_run_config *c) {
    const fl_train_args *t = &c->train;
    if (c->devices < 1 || c->num_nodes < 1)
        return fl_errorf(FL_ERR_INVALID, "devices=%d num_nodes=%d must be >= 1", c->devices, c->num_nodes);
    fl_strategy_choice sc; /* auto: resolvable (its errors are the strategy's) */
    FL_TRY(fl_cfg_resolve_strategy(c, 0, &sc));
    FL_TRY(check_fsdp_options(c, &sc));
    if (c->offload_device[0] && strcmp(c->offload_device, "cpu") && strcmp(c->offload_device, "nvme"))
        return fl_errorf(FL_ERR_INVALID, "offload_optimizer_device '%s': unknown (cpu or nvme)", c->offload_device);
    /* an option the run would not use is refused, never ignored (--strategy deepspeed_stage_3
     * --offload_optimizer_device cpu ran plain ZeRO-3 before) */
    if (c->offload_device[0] && !fl_cfg_offload(c->strategy))
        return fl_errorf(FL_ERR_INVALID, "offload_optimizer_device %s offloads the optimizer of --strategy "
                         "deepspeed_stage_2_offload, deepspeed_stage_1_offload or deepspeed_stage_3_offload; this run's "
                         "strategy is '%s', which keeps the optimizer state on the device%s", c->offload_device,
                         c->strategy[0] ? c->strategy : "auto",
                         !strncmp(c->strategy, "deepspeed_stage_", 16) && strlen(c->strategy) == 17
                             ? " (add _offload to its name to offload it)" : "");
    if (c->offload_param_device[0] && strcmp(c->offload_param_device, "none") && strcmp(c->offload_param_device, "cpu") &&
        strcmp(c->offload_param_device, "nvme"))
        return fl_errorf(FL_ERR_INVALID, "offload_param_device '%s': unknown (none, cpu or nvme)", c->offload_param_device);
    const int poff = fl_cfg_param_offload(c);
    if (c->offload_prefetch < 0)
        return fl_errorf(FL_ERR_INVALID, "offload_prefetch %d: the units fetched ahead must be 0 or more", c->offload_prefetch);
    int stage = 0;
    FL_TRY(fl_cfg_zero_stage(c->strategy, c->sharding_strategy, &stage));
    /* parameter offload moves ZeRO-3's shards; the update then runs where they live (the host), so the
     * optimizer must be offloaded too (DeepSpeed's offload_param is a stage-3 option; Lightning's
     * fsdp_cpu_offload offloads both) */
    if (poff && (stage != 3 || !fl_cfg_offload(c->strategy)))
        return fl_errorf(FL_ERR_INVALID, "offload_param_device %s offloads ZeRO-3's parameter shards, with the optimizer "
                         "on the host: use --strategy deepspeed_stage_3_offload, fsdp_cpu_offload or "
                         "deepspeed_stage_3_offload_nvme; this run's strategy is '%s'", c->offload_param_device,
                         c->strategy[0] ? c->strategy : "auto");
    if (poff && c->command == FL_CMD_FINETUNE_LORA)
        return fl_errorf(FL_ERR_UNSUPPORTED, "parameter offload (offload_param_device %s, --strategy %s) shards and "
                         "offloads the full model's parameters; finetune_lora keeps the frozen base whole on every rank "
                         "and trains its adapters as ZeRO-2: use deepspeed_stage_2_offload or finetune_full",
                         poff == 2 ? "nvme" : "cpu", c->strategy);
    if (c->nvme_path[0] && !fl_cfg_offload_nvme(c) && poff != 2)
        return fl_errorf(FL_ERR_INVALID, "nvme_path '%s' is the folder of offload_optimizer_device nvme's state files and of "
                         "offload_param_device nvme's parameter files; this run offloads nothing to nvme (offload_optimizer_device "
                         "%s, offload_param_device %s)", c->nvme_path,
                         c->offload_device[0] ? c->offload_device : "not given", poff == 1 ? "cpu" : "none");
    if (strcmp(c->state_dict_type, "full") && strcmp(c->state_dict_type, "sharded"))
        return fl_errorf(FL_ERR_INVALID, "fsdp.state_dict_type '%s': unknown (full or sharded)", c->state_dict_type);
    if (!strcmp(c->state_dict_type, "sharded") && c->command == FL_CMD_FINETUNE_LORA)
        return fl_errorf(FL_ERR_UNSUPPORTED, "fsdp.state_dict_type sharded: finetune_lora's checkpoints are PEFT "
                         "adapters (a few MB) and are written whole; sharded checkpoints are for finetune_full and "
                         "pretrain (use full)");
    if (t->micro_batch_size <= 0) return fl_errorf(FL_ERR_INVALID, "train.micro_batch_size must be positive");
    if (t->global_batch_size <= 0) return fl_errorf(FL_ERR_INVALID, "train.global_batch_size must be positive");
    if ((c->devices * c->num_nodes) % c->tensor_parallel)
        return fl_errorf(FL_ERR_INVALID, "tensor_parallel %d does not divide devices x num_nodes = %d rank%s (the ranks "
                         "are data-parallel groups of tensor_parallel ranks each)", c->tensor_parallel,
                         c->devices * c->num_nodes, c->devices * c->num_nodes == 1 ? "" : "s");
    if (c->pipeline_parallel > 1 && (c->devices * c->num_nodes) % c->pipeline_parallel)
        return fl_errorf(FL_ERR_INVALID, "--pipeline_parallel %d does not divide devices x num_nodes = %d rank%s (the "
                         "ranks are pipelines of pipeline_parallel stages each)", c->pipeline_parallel,
                         c->devices * c->num_nodes, c->devices * c->num_nodes == 1 ? "" : "s");
    if (strcmp(c->pipeline_schedule, "gpipe") && strcmp(c->pipeline_schedule, "1f1b") &&
        strcmp(c->pipeline_schedule, "interleaved"))
        return fl_errorf(FL_ERR_INVALID, "--pipeline_schedule '%s': expected gpipe, 1f1b or interleaved",
                         c->pipeline_schedule);
    if (c->pipeline_chunks < 1 || c->pipeline_chunks > 8)
        return fl_errorf(FL_ERR_INVALID, "--pipeline_chunks %d: 1 to 8 model chunks per rank", c->pipeline_chunks);
    const int dpr = fl_cfg_dp_ranks(c);
    int per_rank = t->global_batch_size / dpr;
    if (t->global_batch_size % dpr || per_rank % t->micro_batch_size)
        return fl_errorf(FL_ERR_INVALID,
                         "train.global_batch_size %d is not divisible by %s x micro_batch_size = %d x %d",
                         t->global_batch_size, c->tensor_parallel > 1 || c->pipeline_parallel > 1 ? "data-parallel ranks" : "devices", dpr,
                         t->micro_batch_size);
    if (t->log_interval <= 0) return fl_errorf(FL_ERR_INVALID, "train.log_interval must be positive");
    if (t->lr_warmup_fraction >= 0 && t->lr_warmup_steps > 0)
        return fl_errorf(FL_ERR_INVALID, "train.lr_warmup_fraction %g and train.lr_warmup_steps %d are both given: "
                         "remove one of them (or set it to null); the fraction alone replaces the default steps",
                         (double)t->lr_warmup_fraction, t->lr_warmup_steps);
    if (t->lr_warmup_fraction > 1) return fl_errorf(FL_ERR_INVALID, "train.lr_warmup_fraction must be in [0, 1]");
    if (t->max_seq_length == 0 || t->max_seq_length == 1)
        return fl_errorf(FL_ERR_INVALID, "train.max_seq_length %d: a sample needs at least 2 tokens (an input and "
                         "the next token as its target); use 2 or more, or null", t->max_seq_length);
    if (t->epochs == 0) return fl_errorf(FL_ERR_INVALID, "train.epochs must be positive or null");
    if (t->max_time != -1 && !(t->max_time > 0))
        return fl_errorf(FL_ERR_INVALID, "train.max_time must be a positive number of seconds or null");
    if (c->train.memory_snapshot_interval < 0)
        return fl_errorf(FL_ERR_INVALID, "train.memory_snapshot_interval %d: give 0 (off) or the steps between snapshots",
                         c->train.memory_snapshot_interval);
    if (c->eval.interval <= 0) return fl_errorf(FL_ERR_INVALID, "eval.interval must be positive");
    if (c->eval.max_iters <= 0) return fl_errorf(FL_ERR_INVALID, "eval.max_iters must be positive");
    if (!(c->optimizer.lr > 0) || !isfinite(c->optimizer.lr))
        return fl_errorf(FL_ERR_INVALID, "optimizer.lr must be positive");
    /* a negative floor makes the cosine decay's tail negative (gradient ascent); one above the peak makes it rise */
    if (!(t->min_lr >= 0) || !isfinite(t->min_lr))
        return fl_errorf(FL_ERR_INVALID, "train.min_lr %g must be a finite number >= 0 (the final learning rate of the "
                         "cosine decay)", (double)t->min_lr);
    /* a train.min_lr above optimizer.lr (the default 6e-5 under a fine-tune's lr 1e-5, or a run's own
     * hyperparameters.yaml that records it): not refused, the schedule never rises above the rate (fl_lr_schedule),
     * and the run's header says so */
    if (!(t->max_norm >= 0) || !isfinite(t->max_norm))
        return fl_errorf(FL_ERR_INVALID, "train.max_norm %g: give a positive gradient clipping norm, or 0 / null for "
                         "no clipping", (double)t->max_norm);
    if (c->optimizer.weight_decay < 0) return fl_errorf(FL_ERR_INVALID, "optimizer.weight_decay must be >= 0");
    if (c->data.val_split_fraction < 0 || c->data.val_split_fraction >= 1)
        return fl_errorf(FL_ERR_INVALID, "data.val_split_fraction must be in [0, 1)");
    if (!c->out_dir[0]) return fl_errorf(FL_ERR_INVALID, "out_dir must not be empty");
    if (c->command == FL_CMD_FINETUNE_LORA) {
        if (c->lora.r <= 0) return fl_errorf(FL_ERR_INVALID, "lora_r must be positive");
        if (!(c->lora.alpha > 0)) return fl_errorf(FL_ERR_INVALID, "lora_alpha must be positive");
        if (c->lora.dropout < 0 || c->lora.dropout >= 1) return fl_errorf(FL_ERR_INVALID, "lora_dropout must be in [0, 1)");
        if (c->lora.quantize[0]) {
            fl_q4_type qt;
            int dq;
            FL_TRY(fl_q4_parse_mode(c->lora.quantize, &qt, &dq));
            if (strstr(c->precision, "mixed")) /* as LitGPT: the 4-bit base is dequantized to the precision's dtype */
                return fl_errorf(FL_ERR_INVALID,
                                 "quantize '%s' with precision '%s': quantization and mixed precision are not "
                                 "supported together (use 32-true or bf16-true)",
                                 c->lora.quantize, c->precision);
        }
    }
    if (c->command != FL_CMD_PRETRAIN && !c->checkpoint_dir[0])
        return fl_errorf(FL_ERR_INVALID, "missing checkpoint_dir (the model to fine-tune)");
    if (c->data.kind == FL_DATA_TEXTFILES && !c->data.train_data_path[0])
        return fl_errorf(FL_ERR_INVALID, "data TextFiles needs data.train_data_path");
    if ((c->data.kind == FL_DATA_JSON) && !c->data.json_path[0])
        return fl_errorf(FL_ERR_INVALID, "data JSON needs data.json_path");
    if (c->command == FL_CMD_PRETRAIN) { /* an unknown model_name or unbuildable model_config: say so now */
        fl_model_config mc;
        int have;
        FL_TRY(fl_cfg_model_config(c, &mc, &have));
    }
    return FL_OK;
}

/* ---- dump and help ------------------------------------------------------- */

const char *fl_cfg_command_name(fl_cmd_kind cmd) {
    return cmd == FL_CMD_PRETRAIN ? "pretrain" : cmd == FL_CMD_FINETUNE_LORA ? "finetune_lora" : "finetune_full";
}

