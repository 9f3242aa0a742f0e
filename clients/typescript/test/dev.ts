// startDev runs `better-compute dev` on free ports in a temp dir and reads
// its dev.env, as a person following the README would.
import { fileURLToPath } from "node:url";
import { spawn, spawnSync } from "node:child_process";
import type { ChildProcess } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";

export interface Dev {
  dir: string;
  bin: string;
  env: Record<string, string>;
  /** Runs a binary of bin/ to completion. */
  run(cmd: string, args: string[], stdin?: string): { code: number | null; stdout: string; stderr: string };
  /** Starts a binary of bin/ in the background; stop() ends it. */
  start(cmd: string, args: string[], stdinFile?: string): Background;
  stop(): Promise<void>;
}

export interface Background {
  output(): string;
  exited(): number | null | undefined;
  stop(): Promise<void>;
}

const repo = resolve(dirname(fileURLToPath(import.meta.url)), "../../../..");

// The binaries: $BETTER_COMPUTE_BIN (scripts/test builds them once), else a
// go build into the temp dir.
function binaries(tmp: string): string {
  if (process.env.BETTER_COMPUTE_BIN) return process.env.BETTER_COMPUTE_BIN;
  const bin = join(tmp, "bin");
  const r = spawnSync("go", ["build", "-o", bin + "/", "./cmd/..."], { cwd: repo, encoding: "utf8" });
  if (r.status !== 0) throw new Error(`go build: ${r.stderr}`);
  return bin;
}

function background(child: ChildProcess): Background {
  let out = "";
  let code: number | null | undefined;
  child.stdout?.on("data", (b) => (out += b));
  child.stderr?.on("data", (b) => (out += b));
  const done = new Promise<void>((res) => child.on("exit", (c) => ((code = c), res())));
  // A test process that dies still ends what it started.
  const orphan = () => child.kill("SIGKILL");
  process.once("exit", orphan);
  void done.then(() => process.off("exit", orphan));
  return {
    output: () => out,
    exited: () => code,
    stop: async () => {
      if (code === undefined) child.kill("SIGTERM");
      await done;
    },
  };
}

export async function until(what: string, ok: () => boolean | Promise<boolean>, timeoutMs = 30_000): Promise<void> {
  const end = Date.now() + timeoutMs;
  while (!(await ok())) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

export async function startDev(): Promise<Dev> {
  const tmp = mkdtempSync(join(tmpdir(), "bc-ts-"));
  const bin = binaries(tmp);
  const dir = join(tmp, "bc-dev");
  const child = spawn(join(bin, "better-compute"), ["dev", "--data-dir", dir, "--listen", "127.0.0.1:0",
    "--gateway-listen", "127.0.0.1:0", "--bcd-binary", join(bin, "bcd")], { cwd: tmp, stdio: ["ignore", "pipe", "pipe"] });
  const proc = background(child);
  const others: Background[] = [];
  await until("dev's banner", () => {
    if (proc.exited() !== undefined) throw new Error(`dev exited ${proc.exited()}:\n${proc.output()}`);
    return proc.output().includes("Stop with Ctrl-C");
  }, 60_000);
  const env: Record<string, string> = {};
  for (const line of readFileSync(join(dir, "dev.env"), "utf8").split("\n")) {
    const m = /^export ([A-Z_]+)=(.*)$/.exec(line);
    if (m) env[m[1]] = m[2];
  }
  return {
    dir, bin, env,
    run(cmd, args, stdin) {
      const r = spawnSync(join(bin, cmd), args, { cwd: tmp, input: stdin ?? "", encoding: "utf8" });
      return { code: r.status, stdout: r.stdout, stderr: r.stderr };
    },
    start(cmd, args, stdinFile) {
      const stdin = stdinFile ? readFileSync(stdinFile) : undefined;
      const c = spawn(join(bin, cmd), args, { cwd: tmp, stdio: ["pipe", "pipe", "pipe"] });
      c.stdin?.end(stdin);
      const b = background(c);
      others.push(b);
      return b;
    },
    async stop() {
      for (const b of others) await b.stop();
      await proc.stop();
      rmSync(tmp, { recursive: true, force: true });
    },
  };
}
