// Usage: REDIS_URL=redis://127.0.0.1:6379 node work.js QUEUE
//
// BullMQ's side of cmd/bench's fleet section: one worker on QUEUE, 10 jobs
// at once, at most 20 jobs a second across every worker of the queue
// (BullMQ's limiter is per queue), until SIGTERM.
'use strict';
const { Worker } = require('bullmq');

const name = process.argv[2];
if (!name) {
  console.error('usage: node work.js QUEUE');
  process.exit(2);
}
// The processor does nothing, so what is measured is BullMQ itself, as
// sluice's demo:noop handler measures sluice.
const worker = new Worker(name, async () => {}, {
  connection: { url: process.env.REDIS_URL },
  concurrency: 10,
  limiter: { max: 20, duration: 1000 },
});
worker.on('error', (err) => console.error('work.js:', err));

// Graceful, as the Go workers stop on SIGTERM: finish the jobs running,
// close the connections, and exit 0, which the bench checks.
process.once('SIGTERM', async () => {
  try {
    await worker.close();
    process.exit(0);
  } catch (err) {
    console.error('work.js: close:', err);
    process.exit(1);
  }
});
