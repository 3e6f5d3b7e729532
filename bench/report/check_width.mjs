// The plan report at a laptop's width, in headless Chromium: does anything overflow sideways?
//
//   autopar plan --model gpt3-175b --cluster 128x8 --hardware a100 --batch 1536 --seq 2048 \
//       --dtype fp16 --report plan.html --top 5
//   npm install @sparticuz/chromium@153 puppeteer-core@24      # a Chromium build from the npm registry
//   node bench/report/check_width.mjs plan.html plan.png [1366]
//
// Prints the page's scroll width against the window's and the right edge of the widest element,
// writes a full-page screenshot, and exits 1 when the page scrolls sideways.
import chromium from '@sparticuz/chromium';
import puppeteer from 'puppeteer-core';
import path from 'node:path';

const [html, png, width = '1366'] = process.argv.slice(2);
const browser = await puppeteer.launch({executablePath: await chromium.executablePath(), args: chromium.args,
                                        headless: 'shell'});
const page = await browser.newPage();
await page.setViewport({width: Number(width), height: 900});
await page.goto('file://' + path.resolve(html));
const m = await page.evaluate(() => ({
  scrollWidth: document.documentElement.scrollWidth, clientWidth: document.documentElement.clientWidth,
  widestRight: Math.max(...[...document.querySelectorAll('body *')].map(e => e.getBoundingClientRect().right))}));
console.log(JSON.stringify(m));
await page.screenshot({path: png, fullPage: true});
await browser.close();
process.exit(m.scrollWidth > m.clientWidth ? 1 : 0);
