// Which app config the harness reads, and which of its URLs it lets the engine fetch: its own
// origin's only. A link to the harness with `?config=` of another site would otherwise run that
// site's library in a worker of this origin, checked against that site's digests, and clear this
// origin's cached builds of the same model id.

export const DEFAULT_APP_CONFIG = "/api/app-config.json";

/** `url` resolved against `pageUrl` when it lies on the page's origin, else null (an opaque origin never matches). */
function sameOriginUrl(url, pageUrl) {
  const page = new URL(pageUrl);
  let resolved;
  try {
    resolved = new URL(url, page);
  } catch {
    return null;
  }
  return resolved.origin !== "null" && resolved.origin === page.origin ? resolved : null;
}

/** The URL of the app config to read: `?config=`'s value (`requested`, null when absent) when it lies on the page's origin. */
export function appConfigUrl(requested, pageUrl) {
  const url = sameOriginUrl(requested ?? DEFAULT_APP_CONFIG, pageUrl);
  if (!url) {
    throw new Error(`?config=${requested} is not on this page's origin (${new URL(pageUrl).origin}); ` +
      "the harness reads app configs from its own server only.");
  }
  return url;
}

/** The URLs an app-config record makes the engine fetch: its model folder and its libraries. */
function recordUrls(record) {
  return [record.model, record.model_lib, ...Object.values(record.kiln?.libraries ?? {})]
    .filter((url) => url !== undefined && url !== null);
}

/** Refuse an app config with a model folder or library on another origin than the page's. */
export function checkAppConfigOrigins(appConfig, pageUrl) {
  for (const record of appConfig?.model_list ?? []) {
    const foreign = recordUrls(record).find((url) => !sameOriginUrl(url, pageUrl));
    if (foreign !== undefined) {
      throw new Error(`The app config's model ${record.model_id} lies at ${foreign}, not on this page's origin ` +
        `(${new URL(pageUrl).origin}); the harness loads models from its own server only.`);
    }
  }
}
