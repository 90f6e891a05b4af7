// Usage: REDIS_URL=redis://127.0.0.1:6379 node produce.js QUEUE N
//
// BullMQ's side of cmd/bench's fleet section: adds N jobs named noop to
// QUEUE, then exits.
'use strict';
const { Queue } = require('bullmq');

async function main() {
  const [name, n] = [process.argv[2], Number(process.argv[3])];
  if (!name || !Number.isInteger(n) || n < 0) {
    throw new Error('usage: node produce.js QUEUE N');
  }
  const queue = new Queue(name, { connection: { url: process.env.REDIS_URL } });
  // One add at a time, awaited, as the Go side enqueues one call per task.
  // Default job options on purpose: BullMQ then keeps every completed job
  // (removeOnComplete unset), which is what a user who sets nothing pays.
  for (let i = 0; i < n; i++) {
    await queue.add('noop', {});
  }
  await queue.close();
}

main().catch((err) => {
  console.error('produce.js:', err);
  process.exit(1);
});
