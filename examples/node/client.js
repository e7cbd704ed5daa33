#!/usr/bin/env node
// pdserve Node client example: loads protos/ at run time (@grpc/proto-loader), calls the gateway's
// Generate (server streaming; prints the text as it arrives) and Complete (unary), and prints one
// JSON summary line per call with finish_reason and usage.
//
//   cd examples/node && npm ci
//   node client.js --address 127.0.0.1:50051 --prompt "Why is the sky blue?" --max-tokens 32
//   node client.js --message "Tell me a joke" --rpc generate
//   node client.js --api-key "$PDSERVE_API_KEY"     # when the gateway has API keys
//
// Output (stdout): the streamed text, then a line {"rpc":"Generate",...}; then the Complete text and
// a line {"rpc":"Complete",...}. Errors go to stderr as "error: <rpc>: <STATUS>: <details>" (exit 1).
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const USAGE = `usage: node client.js [options]
  --address HOST:PORT   gateway address (default 127.0.0.1:50051)
  --prompt TEXT         raw prompt (no chat template)
  --message TEXT        one user chat message (chat template applied); default when no --prompt
  --system TEXT         a system message before --message
  --max-tokens N        maximum generated tokens (default 32)
  --temperature T       sampling temperature (default: server's; 0 = greedy)
  --seed N              sampling seed
  --model ID            model id (default: the deployment's only model)
  --rpc generate|complete|both   which calls to make (default both)
  --timeout-s S         deadline per call in seconds (default 120)
  --protos DIR          folder holding pdserve/v1/*.proto (default: the repository's protos/)
  --tls                 use TLS (system roots) instead of plaintext
  --api-key KEY         send 'authorization: Bearer KEY' metadata (gateways started with --api-key)`;

function parseArgs(argv) {
  const opts = {
    address: '127.0.0.1:50051',
    prompt: null,
    message: null,
    system: null,
    maxTokens: 32,
    temperature: null,
    seed: null,
    model: '',
    rpc: 'both',
    timeoutS: 120,
    protos: path.resolve(__dirname, '..', '..', 'protos'),
    tls: false,
    apiKey: '',
  };
  const takes = {
    '--address': 'address', '--prompt': 'prompt', '--message': 'message', '--system': 'system',
    '--max-tokens': 'maxTokens', '--temperature': 'temperature', '--seed': 'seed',
    '--model': 'model', '--rpc': 'rpc', '--timeout-s': 'timeoutS', '--protos': 'protos',
    '--api-key': 'apiKey',
  };
  for (let i = 0; i < argv.length; i++) {
    let arg = argv[i];
    let value = null;
    const eq = arg.indexOf('=');
    if (arg.startsWith('--') && eq > 0) {
      value = arg.slice(eq + 1);
      arg = arg.slice(0, eq);
    }
    if (arg === '-h' || arg === '--help') {
      console.log(USAGE);
      process.exit(0);
    } else if (arg === '--tls') {
      opts.tls = true;
    } else if (arg in takes) {
      if (value === null) {
        if (i + 1 >= argv.length) usageError(`${arg} needs a value`);
        value = argv[++i];
      }
      opts[takes[arg]] = value;
    } else {
      usageError(`unknown argument ${arg}`);
    }
  }
  opts.maxTokens = toInt(opts.maxTokens, '--max-tokens');
  opts.timeoutS = Number(opts.timeoutS);
  if (!(opts.timeoutS > 0)) usageError('--timeout-s must be > 0');
  if (opts.temperature !== null) {
    opts.temperature = Number(opts.temperature);
    if (!(opts.temperature >= 0)) usageError('--temperature must be >= 0');
  }
  if (opts.seed !== null) opts.seed = String(toInt(opts.seed, '--seed'));
  if (!['generate', 'complete', 'both'].includes(opts.rpc)) usageError('--rpc must be generate, complete or both');
  if (opts.prompt === null && opts.message === null) opts.message = 'Why is the sky blue?';
  return opts;
}

function toInt(value, name) {
  const n = Number(value);
  if (!Number.isInteger(n) || n < 0) usageError(`${name} must be a non-negative integer`);
  return n;
}

function usageError(msg) {
  console.error(`client.js: ${msg}\n\n${USAGE}`);
  process.exit(2);
}

function loadGateway(protosDir) {
  const definition = protoLoader.loadSync('pdserve/v1/gateway.proto', {
    includeDirs: [protosDir],
    keepCase: true, // field names as in the .proto (snake_case)
    longs: Number, // uint64 counts fit in a double
    enums: String, // "FINISH_REASON_STOP"
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).pdserve.v1.Gateway;
}

function buildRequest(opts) {
  const req = { model: opts.model, max_tokens: opts.maxTokens };
  if (opts.prompt !== null) {
    req.prompt = opts.prompt;
  } else {
    req.messages = [];
    if (opts.system !== null) req.messages.push({ role: 'system', content: opts.system });
    req.messages.push({ role: 'user', content: opts.message });
  }
  if (opts.temperature !== null) req.temperature = opts.temperature;
  if (opts.seed !== null) req.seed = opts.seed;
  return req;
}

function metadata(opts) {
  const md = new grpc.Metadata();
  if (opts.apiKey) md.set('authorization', `Bearer ${opts.apiKey}`);
  return md;
}

function deadline(opts) {
  return new Date(Date.now() + opts.timeoutS * 1000);
}

function usageJson(usage) {
  const u = usage || {};
  const keys = ['prompt_tokens', 'completion_tokens', 'cached_tokens', 'local_cached_tokens',
    'transferred_cached_tokens', 'total_tokens'];
  const out = {};
  for (const k of keys) out[k] = Number(u[k] || 0);
  return out;
}

function rpcError(rpc, err) {
  const code = grpc.status[err.code] || String(err.code);
  return new Error(`${rpc}: ${code}: ${err.details || err.message}`);
}

function generate(client, opts) {
  return new Promise((resolve, reject) => {
    const call = client.Generate(buildRequest(opts), metadata(opts), { deadline: deadline(opts) });
    const started = Date.now();
    let text = '';
    let frames = 0;
    let firstFrameMs = null;
    let last = null;
    const onSignal = () => call.cancel();
    process.once('SIGINT', onSignal);
    call.on('data', (frame) => {
      frames += 1;
      if (firstFrameMs === null) firstFrameMs = Date.now() - started;
      if (frame.text) {
        text += frame.text;
        process.stdout.write(frame.text);
      }
      last = frame;
    });
    call.on('error', (err) => {
      process.removeListener('SIGINT', onSignal);
      reject(rpcError('Generate', err));
    });
    call.on('end', () => {
      process.removeListener('SIGINT', onSignal);
      if (last === null || last.kind !== 'FRAME_KIND_FINAL') {
        reject(new Error('Generate: stream ended without a FINAL frame'));
        return;
      }
      process.stdout.write('\n');
      resolve({
        rpc: 'Generate',
        request_id: last.request_id,
        model: last.model,
        finish_reason: last.finish_reason,
        usage: usageJson(last.usage),
        frames,
        text,
        first_frame_ms: firstFrameMs,
        elapsed_ms: Date.now() - started,
      });
    });
  });
}

function complete(client, opts) {
  return new Promise((resolve, reject) => {
    const started = Date.now();
    client.Complete(buildRequest(opts), metadata(opts), { deadline: deadline(opts) }, (err, resp) => {
      if (err) {
        reject(rpcError('Complete', err));
        return;
      }
      process.stdout.write(resp.text + '\n');
      resolve({
        rpc: 'Complete',
        request_id: resp.request_id,
        model: resp.model,
        finish_reason: resp.finish_reason,
        usage: usageJson(resp.usage),
        text: resp.text,
        elapsed_ms: Date.now() - started,
      });
    });
  });
}

async function main() {
  const opts = parseArgs(process.argv.slice(2));
  const Gateway = loadGateway(opts.protos);
  const creds = opts.tls ? grpc.credentials.createSsl() : grpc.credentials.createInsecure();
  const client = new Gateway(opts.address, creds);
  try {
    if (opts.rpc !== 'complete') console.log(JSON.stringify(await generate(client, opts)));
    if (opts.rpc !== 'generate') console.log(JSON.stringify(await complete(client, opts)));
  } finally {
    client.close();
  }
}

main().catch((err) => {
  console.error(`error: ${err.message}`);
  process.exitCode = 1;
});
